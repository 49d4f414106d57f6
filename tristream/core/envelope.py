"""Lower-envelope line fit for (source time, arrival time) pairs: the minimum-delay estimator.

Arrival = capture on the reference clock + delay, and delay >= a fixed minimum. The capture
line therefore runs along the *lower envelope* of the points, not through their middle, and
heavy-tailed jitter, spikes and bursts (all above the envelope) do not move it.

`fit_lower_envelope` fits one shared slope (the drift) and one intercept per epoch (a clock
reset keeps the drift but moves the offset) by low-quantile regression: minimise
sum(rho_q(y - c_e - d*x)). With q -> 0 this is the classic LP minimum-delay fit (Moon, Skelly &
Towsley 1999); a small q > 0 lets a few points lie below the line, so a handful of too-early
outliers cannot drag it down. For a fixed slope the best intercept is the q-quantile of the
epoch's residuals, and the profile objective is convex in the slope, so a golden-section search
over the slope finds the optimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True, slots=True)
class EnvelopeFit:
    """Result of a fit: `y ~ intercepts[e] + slope * x` on the lower envelope of epoch e."""

    slope: float
    intercepts: np.ndarray
    at_bound: bool
    spread: np.ndarray  # per epoch: median gap of the points above the line (envelope tightness)


def _quantile_index(n: int, q: float, min_below: int = 0) -> int:
    k = int(math.floor(q * n))
    if n >= 4 * (min_below + 1):
        k = max(k, min_below)
    return min(n - 1, k)


def _profile(x: list[np.ndarray], y: list[np.ndarray], slope: float, q: float,
             min_below: int = 0) -> tuple[float, list[float]]:
    total = 0.0
    cs: list[float] = []
    for xe, ye in zip(x, y, strict=True):
        z = ye - slope * xe
        n = z.size
        k = _quantile_index(n, q, min_below)
        zp = np.partition(z, k)
        c = float(zp[k])
        # sum of rho_q(z - c) = q * sum(z - c) - sum over the k points below c of (z - c)
        below = float(zp[:k].sum()) - k * c if k else 0.0
        total += q * (float(z.sum()) - n * c) - below
        cs.append(c)
    return total, cs


def fit_lower_envelope(
    x: list[np.ndarray],
    y: list[np.ndarray],
    *,
    q: float,
    slope_bound: float,
    fixed_slope: float | None = None,
    guess: float | None = None,
    guess_width: float = 20e-6,
    tol: float = 1e-9,
    min_below: int = 0,
) -> EnvelopeFit:
    """Fit a shared slope and per-epoch intercepts to the lower q-quantile of the points.

    `x[e]`, `y[e]` are float arrays of epoch e (x: source time since the epoch origin,
    y: arrival minus source time, both ns). The slope is searched in [-slope_bound,
    slope_bound]; with `fixed_slope` only the intercepts are fitted. With `guess`, the search
    starts in [guess - guess_width, guess + guess_width] and widens to the full range only if
    the optimum lands on that bracket's edge (the objective is convex, so this is exact).
    `min_below` lets at least that many points of an epoch with 4 * (min_below + 1) points or
    more lie below its line, whatever q (robustness for short epochs).
    """
    if len(x) != len(y) or not x:
        raise ValueError("fit_lower_envelope needs one (x, y) pair of arrays per epoch")
    if not 0.0 <= q < 0.5:
        raise ValueError(f"q={q}; expected a low quantile in [0, 0.5)")
    if fixed_slope is not None:
        slope = fixed_slope
        at_bound = False
    else:
        slope = math.nan
        if guess is not None:
            lo = max(-slope_bound, guess - guess_width)
            hi = min(slope_bound, guess + guess_width)
            slope = _golden(x, y, q, lo, hi, tol, min_below)
            inner = (lo > -slope_bound and slope - lo < 2 * tol) or (hi < slope_bound and hi - slope < 2 * tol)
            if inner:
                slope = math.nan
        if math.isnan(slope):
            slope = _golden(x, y, q, -slope_bound, slope_bound, tol, min_below)
        at_bound = abs(abs(slope) - slope_bound) < 1e-3 * slope_bound
    _, cs = _profile(x, y, slope, q, min_below)
    spread = np.array(
        [float(np.median(np.maximum(ye - slope * xe - c, 0.0))) for xe, ye, c in zip(x, y, cs, strict=True)]
    )
    return EnvelopeFit(slope=slope, intercepts=np.array(cs), at_bound=at_bound, spread=spread)


def _golden(x: list[np.ndarray], y: list[np.ndarray], q: float, lo: float, hi: float, tol: float,
            min_below: int) -> float:
    a = hi - _GOLDEN * (hi - lo)
    b = lo + _GOLDEN * (hi - lo)
    fa = _profile(x, y, a, q, min_below)[0]
    fb = _profile(x, y, b, q, min_below)[0]
    while hi - lo > tol:
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - _GOLDEN * (hi - lo)
            fa = _profile(x, y, a, q, min_below)[0]
        else:
            lo, a, fa = a, b, fb
            b = lo + _GOLDEN * (hi - lo)
            fb = _profile(x, y, b, q, min_below)[0]
    return 0.5 * (lo + hi)
