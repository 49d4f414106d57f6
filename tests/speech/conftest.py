from __future__ import annotations

import pytest
import torch

from tristream.speech.config import WhisperDims
from tristream.speech.whisper import Whisper

TINY = WhisperDims(d_model=64, encoder_layers=2, decoder_layers=2, heads=4, ffn=128,
                   max_source_positions=250, max_target_positions=64)


def random_whisper(dims: WhisperDims = TINY, seed: int = 0) -> Whisper:
    """Our Whisper with seeded random weights (random weights only; no hub)."""
    m = Whisper(dims).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("ln1.weight") or name.endswith("ln2.weight") or "ln.weight" in name or "lnx.weight" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m


@pytest.fixture(scope="module")
def tiny_whisper() -> Whisper:
    return random_whisper()


@pytest.fixture(scope="module")
def make_whisper():  # type: ignore[no-untyped-def]
    """Factory for seeded random tiny Whisper models."""
    return random_whisper
