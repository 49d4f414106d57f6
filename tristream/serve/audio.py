"""Small PCM helpers for the serving layer: base64 pcm16 <-> numpy, and rate conversion.

OpenAI Realtime clients send 24 kHz pcm16; the speech stages want 16 kHz. Conversion is a
windowed-sinc low-pass (when going down) followed by linear interpolation: vectorised numpy,
cheap enough for 20 ms chunks, and good enough for VAD and ASR (not for music).
"""

from __future__ import annotations

import base64
from functools import lru_cache

import numpy as np


def decode_pcm16(data: bytes) -> np.ndarray:
    """Little-endian int16 bytes -> int16 array (copy-free view)."""
    return np.frombuffer(data, dtype="<i2")


def encode_pcm16_b64(pcm: np.ndarray) -> str:
    """int16 array -> base64 of little-endian bytes."""
    return base64.b64encode(np.asarray(pcm, dtype="<i2").tobytes()).decode("ascii")


@lru_cache(maxsize=16)
def _lowpass_kernel(cutoff: float, taps: int = 31) -> np.ndarray:
    n = np.arange(taps) - (taps - 1) / 2
    h = np.sinc(2 * cutoff * n) * np.hamming(taps)
    return (h / h.sum()).astype(np.float32)


def resample_int16(pcm: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Convert int16 mono audio between rates (chunk-local: no state across calls)."""
    if src_rate == dst_rate or pcm.size == 0:
        return np.asarray(pcm, dtype=np.int16)
    x = pcm.astype(np.float32)
    if dst_rate < src_rate:
        k = _lowpass_kernel(0.5 * dst_rate / src_rate * 0.9)
        # "full" then centre: equals mode="same" for long chunks and keeps the length for
        # chunks shorter than the kernel (mode="same" would return the kernel's length).
        off = (k.size - 1) // 2
        x = np.convolve(x, k, mode="full")[off:off + pcm.size]
    n_out = int(round(pcm.size * dst_rate / src_rate))
    t = np.arange(n_out, dtype=np.float64) * (src_rate / dst_rate)
    y = np.interp(t, np.arange(pcm.size, dtype=np.float64), x)
    return np.clip(np.rint(y), -32768, 32767).astype(np.int16)
