"""Engine step-time model: milliseconds per step as a function of batch composition.

    t = [llm] (c0 + c_dec * decode_bucket + c_pf * prefill_tokens)
      + [images > 0] (v0 + v1 * image_bucket)
      + [asr > 0]    (a0 + a1 * asr_bucket)

Decode pads to the captured CUDA-graph bucket, so it is charged per bucket slot. The
coefficients are a least-squares fit (`fit_step_time`) to the rows in
`bench/data/sched_steptime.csv` — H200 figures measured in this workplace (ANCHORS.md for the
LLM, our graphed SigLIP / Whisper runners from `bench/results/encoders.json` at a73ab05) and, where no
measurement exists, roofline-derived rows that say so; `bench/sched.py --fit`
redoes the fit and writes `bench/data/sched_steptime_fit.json`. The scheduler uses the same
model to estimate the cost of a plan; the simulator adds seeded jitter on top.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

DECODE_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
IMAGE_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
ASR_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest captured bucket holding n (0 for n == 0); raises past the largest."""
    if n <= 0:
        return 0
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"batch of {n} exceeds the largest captured bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Fitted coefficients (ms)."""

    c0: float = 1.81425
    c_dec: float = 0.0079861
    c_pf: float = 0.0064857
    v0: float = 0.704074
    v1: float = 0.123307
    a0: float = 5.98322
    a1: float = 0.10608
    source: str = "fit to bench/data/sched_steptime.csv (H200: ANCHORS LLM row, encoders.json, roofline rows)"

    def step_ms(self, decode: int, prefill_tokens: int, images: int, asr_units: int) -> float:
        """Modelled duration of one step (decode/images/asr are raw counts, padded here)."""
        t = 0.0
        if decode > 0 or prefill_tokens > 0:
            t += self.c0 + self.c_dec * bucket_for(decode, DECODE_BUCKETS) + self.c_pf * prefill_tokens
        if images > 0:
            t += self.v0 + self.v1 * bucket_for(images, IMAGE_BUCKETS)
        if asr_units > 0:
            t += self.a0 + self.a1 * bucket_for(asr_units, ASR_BUCKETS)
        return t

    def to_dict(self) -> dict[str, float | str]:
        """Plain dict for JSON."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured or derived step: composition and time in ms."""

    component: str
    decode: int
    prefill_tokens: int
    images: int
    asr_units: int
    ms: float
    source: str


def _lstsq(x: np.ndarray, y: np.ndarray, nonneg: bool = False) -> np.ndarray:
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    coef = np.asarray(coef, dtype=np.float64)
    if nonneg:  # active-set clipping: force negative coefficients to 0 and refit the rest
        keep = np.ones(len(coef), dtype=bool)
        while (coef[keep] < 0).any():
            keep &= coef >= 0
            coef = np.zeros_like(coef)
            if keep.any():
                sub, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
                coef[keep] = sub
    return coef


def fit_step_time(samples: Sequence[StepSample], source: str, nonneg: bool = False) -> StepTimeModel:
    """Least-squares fit of each component's (fixed, per-unit) pair to its samples.

    `nonneg` clips negative coefficients to zero (noisy measured data); without it a
    negative coefficient is an error (committed data must fit cleanly)."""
    by: dict[str, list[StepSample]] = {"llm": [], "vision": [], "asr": []}
    for s in samples:
        if s.component not in by:
            raise ValueError(f"unknown component {s.component!r}; expected llm, vision or asr")
        by[s.component].append(s)
    for name, rows in by.items():
        if len(rows) < 2:
            raise ValueError(f"need at least 2 {name} samples to fit, got {len(rows)}")
    llm = by["llm"]
    x = np.array([[1.0, bucket_for(s.decode, DECODE_BUCKETS), s.prefill_tokens] for s in llm])
    c0, c_dec, c_pf = _lstsq(x, np.array([s.ms for s in llm]), nonneg)
    vis = by["vision"]
    v0, v1 = _lstsq(
        np.array([[1.0, bucket_for(s.images, IMAGE_BUCKETS)] for s in vis]), np.array([s.ms for s in vis]), nonneg
    )
    asr = by["asr"]
    a0, a1 = _lstsq(
        np.array([[1.0, bucket_for(s.asr_units, ASR_BUCKETS)] for s in asr]), np.array([s.ms for s in asr]), nonneg
    )
    coefs = [float(c) for c in (c0, c_dec, c_pf, v0, v1, a0, a1)]
    if any(c < 0 or not math.isfinite(c) for c in coefs):
        raise ValueError(f"step-time fit gave a negative or non-finite coefficient: {coefs}")
    c0, c_dec, c_pf, v0, v1, a0, a1 = coefs
    return StepTimeModel(c0=c0, c_dec=c_dec, c_pf=c_pf, v0=v0, v1=v1, a0=a0, a1=a1, source=source)


def read_samples_csv(text: str) -> list[StepSample]:
    """Parse `component,decode,prefill_tokens,images,asr_units,ms,source` rows (# comments ok)."""
    out: list[StepSample] = []
    for ln, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("component,"):
            continue
        parts = line.split(",", 6)
        if len(parts) != 7:
            raise ValueError(f"line {ln}: expected 7 comma-separated fields, got {len(parts)}: {line!r}")
        c, d, p, i, a, ms, src = parts
        out.append(StepSample(c.strip(), int(d), int(p), int(i), int(a), float(ms), src.strip()))
    return out


class CalibratedStepTime:
    """A step-time model corrected online by the measured/predicted ratio (EWMA).

    Used against the real engine, whose step times differ from the fitted model (other
    kernels, other shapes): plans and step budgets then stay in real milliseconds.
    """

    def __init__(self, base: StepTimeModel | None = None, alpha: float = 0.05,
                 bounds: tuple[float, float] = (0.1, 20.0)) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.base = base or StepTimeModel()
        self.alpha = alpha
        self.bounds = bounds
        self.ratio = 1.0
        self.observations = 0

    def step_ms(self, decode: int, prefill_tokens: int, images: int, asr_units: int) -> float:
        """Base prediction times the learned ratio."""
        return self.base.step_ms(decode, prefill_tokens, images, asr_units) * self.ratio

    def observe(self, decode: int, prefill_tokens: int, images: int, asr_units: int, measured_ms: float) -> None:
        """Fold one measured step into the ratio."""
        pred = self.base.step_ms(decode, prefill_tokens, images, asr_units)
        if pred <= 0 or measured_ms <= 0:
            return
        r = min(self.bounds[1], max(self.bounds[0], measured_ms / pred))
        self.ratio += self.alpha * (r - self.ratio)
        self.observations += 1
