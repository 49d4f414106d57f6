"""Plain reference loops of the word-timing code, and the small inputs the speech tests share."""

from __future__ import annotations

from typing import Any

import numpy as np

from tristream.speech.config import WhisperTokens
from tristream.speech.runner import WhisperRunner
from tristream.speech.whisper import Whisper

TOKENS = WhisperTokens.for_vocab(51865)


def tone(seconds: float, seed: int, hz: float = 200.0, step_hz: float = 50.0) -> np.ndarray:
    """A noisy sine of `hz + step_hz * seed` (16 kHz float32): audio that differs per seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * (hz + step_hz * seed) * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def small_runner(model: Whisper, **kw: Any) -> WhisperRunner:
    """A runner on buckets of 1-4 streams x 2 / 5 s, chunks of 4 steps, no early stop; `kw` overrides."""
    args: dict[str, Any] = dict(batch_buckets=(1, 2, 4), audio_buckets_s=(2.0, 5.0), max_new_tokens=10, chunk=4,
                                early_stop=False)
    args.update(kw)
    return WhisperRunner(model, TOKENS, **args)


def dtw_reference(cost: np.ndarray) -> list[int]:
    """Plain O(N·M) DTW (whisper's loop) on one `[N, M]` cost; entry frame per row. For tests."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.zeros((n + 1, m + 1), dtype=np.int64)
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c = (acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])
            k = int(np.argmin(c))
            acc[i, j] = cost[i - 1, j - 1] + c[k]
            trace[i, j] = k
    i, j = n, m
    starts = [0] * n
    while i > 0 and j > 0:
        starts[i - 1] = j - 1
        t = trace[i, j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    return starts
