"""PCM helpers for the serving layer: base64 pcm16 <-> numpy (rates change in one place:
`tristream.stages.base.Resampler`)."""

from __future__ import annotations

import base64

import numpy as np


def decode_pcm16(data: bytes) -> np.ndarray:
    """Little-endian int16 bytes -> int16 array (copy-free view)."""
    return np.frombuffer(data, dtype="<i2")


def encode_pcm16_b64(pcm: np.ndarray) -> str:
    """int16 array -> base64 of little-endian bytes."""
    return base64.b64encode(np.asarray(pcm, dtype="<i2").tobytes()).decode("ascii")
