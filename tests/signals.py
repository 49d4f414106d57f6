"""Synthetic speech-like signals for tests that need voiced audio without a TTS."""

from __future__ import annotations

import numpy as np

FORMANTS = ((700.0, 90.0), (1200.0, 110.0))


def resonate(src: np.ndarray, rate: int, formants: tuple[tuple[float, float], ...] = FORMANTS) -> np.ndarray:
    """`src` through one two-pole resonator per (centre Hz, bandwidth Hz), summed; in `src`'s dtype."""
    n = src.size
    x = np.zeros(n, src.dtype)
    for f, bw in formants:
        r = np.exp(-np.pi * bw / rate)
        a1, a2 = 2 * r * np.cos(2 * np.pi * f / rate), -r * r
        y = np.zeros(n, src.dtype)
        for i in range(2, n):
            y[i] = src[i] + a1 * y[i - 1] + a2 * y[i - 2]
        x += y
    return x


def voiced_bursts(seconds: float, seed: int = 7) -> np.ndarray:
    """`seconds` of 16 kHz voiced bursts in about [-0.3, 0.3] (float64): a 120 Hz pulse train through
    two formant resonances, on for 0.3-0.9 s, off for 0.4 s, over low noise."""
    rng = np.random.default_rng(seed)
    n = int(16000 * seconds)
    t = np.arange(n) / 16000
    x = resonate((np.sin(2 * np.pi * 120 * t) > 0.97).astype(np.float32), 16000)
    gate = np.zeros(n, np.float32)
    pos = 0
    while pos < n:
        on = int(16000 * rng.uniform(0.3, 0.9))
        gate[pos:pos + on] = 1.0
        pos += on + 6400
    return 0.3 * x / np.max(np.abs(x)) * gate + 0.002 * rng.standard_normal(n)
