"""Lower-envelope *curve* of (source time, arrival - source time) points: the offline clock map.

A crystal whose rate follows its temperature bends the map from source to reference time by a
millisecond or more over minutes, so one straight line per epoch is not enough. The map is a
piecewise-linear curve with knots every `knot_ns` of source time, fitted to the lower envelope:

1. the points are binned (`bin_ns`); each bin keeps its least-delay point, or its second one
   when the least is isolated more than `early_ns` below it (a packet stamped late); a bin
   more than `outlier_ns` below the third-lowest of its neighbours within 2 s is dropped;
2. the knot values minimise an *asymmetric* penalised least-squares objective over the bin
   minima: points below the curve weigh 1, points above weigh `above_weight`, plus `smooth`
   times the squared second differences of the knots (this also bridges silent stretches), in
   proportion to the bins per knot below 8 (`smooth` holds for 8 or more).
   Bins more than `congestion_ns` above the lowest bin within `congestion_window_ns` (drift
   removed) are left out first: a congestion episode lifts every delay for seconds, and at the
   end of an epoch nothing else would hold the curve down.
   Iterated (IRLS) it settles on the low edge of the bin minima; bins far above (congestion
   episodes, stalls) or implausibly far below (stamped late) are then rejected and the curve
   refitted.

The knots' system is pentadiagonal and solved by a banded Cholesky factorisation in O(knots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class LowerCurve:
    """y(x) = piecewise-linear through `values` at x0 + k * step (linear beyond the ends)."""

    x0: float
    step: float
    values: np.ndarray

    def __call__(self, x: np.ndarray) -> np.ndarray:
        v = self.values
        if v.size == 1:
            return np.full(np.shape(x), float(v[0]))
        u = (np.asarray(x, dtype=np.float64) - self.x0) / self.step
        # clipped first, truncation is the floor; the segments' rises are v[j + 1] - v[j] as they are
        j = np.clip(u, 0, v.size - 2).astype(np.int64)
        w = np.subtract(u, j, out=u) if u.ndim else u - j
        w *= (v[1:] - v[:-1])[j]
        w += v[j]
        return w

    def slopes(self) -> np.ndarray:
        """Slope of each segment (dimensionless: ns per ns)."""
        return np.diff(self.values) / self.step if self.values.size > 1 else np.zeros(1)


def bin_minima(x: np.ndarray, y: np.ndarray, bin_ns: float, early_ns: float) -> tuple[np.ndarray, np.ndarray, int]:
    """Per bin of `bin_ns` along x: the least-delay point (x, y), or the second when the least is
    more than `early_ns` below it. Returns (xb, yb, bins whose least point was set aside)."""
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order]
    b = ((xs - xs[0]) / bin_ns).astype(np.int64)  # >= 0: truncation is the floor
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    counts = np.diff(np.r_[starts, xs.size])
    m1 = np.minimum.reduceat(ys, starts)
    rep = np.repeat(m1, counts)
    at_min = ys == rep
    first = np.flatnonzero(at_min & np.r_[True, ~at_min[:-1] | (b[1:] != b[:-1])])
    # one position per bin: the first point equal to its bin's minimum
    first = first[np.r_[True, b[first[1:]] != b[first[:-1]]]]
    ys2 = ys.copy()
    ys2[first] = np.inf
    m2 = np.minimum.reduceat(ys2, starts)
    early = (m2 - m1 > early_ns) & np.isfinite(m2)
    xb = xs[first].astype(np.float64)
    yb = m1.astype(np.float64)
    if early.any():
        ys2[first] = ys[first]
        # second-least point of the flagged bins
        mask2 = ys2 == np.repeat(np.where(early, m2, np.nan), counts)
        idx2 = np.flatnonzero(mask2)
        idx2 = idx2[np.r_[True, b[idx2[1:]] != b[idx2[:-1]]]]
        bins2 = np.searchsorted(starts, idx2, side="right") - 1
        xb[bins2] = xs[idx2]
        yb[bins2] = ys[idx2]
    return xb, yb, int(early.sum())


def _solve_penta(d0: np.ndarray, d1: np.ndarray, d2: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve A v = rhs for symmetric positive-definite pentadiagonal A (diagonals d0, d1, d2)."""
    n = d0.size
    if n <= 256:
        a = np.diag(d0) + np.diag(d1, 1) + np.diag(d1, -1) + np.diag(d2, 2) + np.diag(d2, -2)
        return np.asarray(np.linalg.solve(a, rhs))
    # LDL^T with bandwidth 2, in plain floats (O(n), n = knots), the factorisation and the forward
    # substitution in one pass with the last two rows' values in locals; rows 0, 1, n-2 and n-1
    # (fewer terms) apart
    a0, a1, a2, b = d0.tolist(), d1.tolist(), d2.tolist(), rhs.tolist()
    dd = [0.0] * n
    l1 = [0.0] * n
    l2 = [0.0] * n
    z = [0.0] * n
    d_2 = a0[0]
    p_2 = a1[0] / d_2
    q_2 = a2[0] / d_2
    z_2 = b[0]
    dd[0], l1[0], l2[0], z[0] = d_2, p_2, q_2, z_2
    d_1 = a0[1] - p_2 * p_2 * d_2
    p_1 = (a1[1] - p_2 * q_2 * d_2) / d_1
    q_1 = a2[1] / d_1
    z_1 = b[1] - p_2 * z_2
    dd[1], l1[1], l2[1], z[1] = d_1, p_1, q_1, z_1
    for i in range(2, n - 2):
        di = a0[i] - p_1 * p_1 * d_1 - q_2 * q_2 * d_2
        p = (a1[i] - p_1 * q_1 * d_1) / di
        q = a2[i] / di
        zi = b[i] - p_1 * z_1 - q_2 * z_2
        dd[i], l1[i], l2[i], z[i] = di, p, q, zi
        d_2, q_2, z_2, d_1, p_1, q_1, z_1 = d_1, q_1, z_1, di, p, q, zi
    i = n - 2
    di = a0[i] - p_1 * p_1 * d_1 - q_2 * q_2 * d_2
    p = (a1[i] - p_1 * q_1 * d_1) / di
    zi = b[i] - p_1 * z_1 - q_2 * z_2
    dd[i], l1[i], z[i] = di, p, zi
    d_2, q_2, z_2, d_1, p_1, z_1 = d_1, q_1, z_1, di, p, zi
    i = n - 1
    dd[i] = a0[i] - p_1 * p_1 * d_1 - q_2 * q_2 * d_2
    z[i] = b[i] - p_1 * z_1 - q_2 * z_2
    out = [0.0] * n
    o2 = z[n - 1] / dd[n - 1]
    o1 = z[n - 2] / dd[n - 2] - l1[n - 2] * o2
    out[n - 1], out[n - 2] = o2, o1
    for i in range(n - 3, -1, -1):
        v = z[i] / dd[i] - l1[i] * o1 - l2[i] * o2
        out[i] = v
        o2, o1 = o1, v
    return np.array(out)


def fit_lower_curve(
    x: np.ndarray,
    y: np.ndarray,
    *,
    knot_ns: float = 5e9,
    bin_ns: float = 0.5e9,
    early_ns: float = 1e6,
    above_weight: float = 0.001,
    smooth: float = 0.2,
    iters: int = 12,
    congestion_ns: float = 2e6,
    congestion_window_ns: float = 12e9,
    outlier_ns: float = 0.3e6,
) -> tuple[LowerCurve, dict[str, int]]:
    """Fit the lower-envelope curve of (x, y) (both ns, float); returns it and what was set aside."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.size == 0:
        raise ValueError("fit_lower_curve needs at least one point")
    xb, yb, n_early = bin_minima(x, y, bin_ns, early_ns)
    if xb.size >= 8:
        ok = ~_too_early(xb, yb, bin_ns, outlier_ns)
        n_early += int((~ok).sum())
        xb, yb = xb[ok], yb[ok]
    span = float(x.max() - x.min())
    x0 = float(x.min())
    if span < 2 * bin_ns or xb.size < 3:
        k = int(np.argmin(yb))
        return LowerCurve(x0, max(span, 1.0), np.array([yb[k], yb[k]])), {"early_bins": n_early, "rejected_bins": 0}
    trend = _detrend(xb, yb) if xb.size >= 8 else None  # both tests below take the same residuals
    congested = _congested(xb, yb, bin_ns, congestion_ns, congestion_window_ns, trend)
    if xb.size >= 8 and bin_ns * 8 <= 2e9:
        # Bins with neighbours on one side only (the ends of an epoch, the edges of a silence),
        # against that side's bins outside congestion episodes; only with 8 of them a side (a
        # sparse source's few bins there hold more jitter than evidence).
        late = _too_early(xb, yb, bin_ns, outlier_ns, skip=congested, edges=True, resid=trend) & ~congested
        if late.any():
            n_early += int(late.sum())
            xb, yb, congested = xb[~late], yb[~late], congested[~late]
    if congested.any() and not congested.all():
        xb, yb = xb[~congested], yb[~congested]
    m = max(2, int(math.ceil(span / knot_ns)) + 1)
    step = span / (m - 1)
    u = (xb - x0) / step
    j = np.clip(np.floor(u), 0, m - 2).astype(np.int64)
    w1 = u - j
    w0 = 1.0 - w1
    dtd0 = np.full(m, 6.0)
    dtd0[[0, -1]] = 1.0
    if m > 2:
        dtd0[[1, -2]] = 5.0
    dtd1 = np.full(m - 1, -4.0)
    dtd1[[0, -1]] = -2.0
    dtd2 = np.ones(max(m - 2, 0))
    if m < 4:  # too few knots for a second-difference penalty to be banded as above: straight line
        dtd0, dtd1, dtd2 = np.zeros(m), np.zeros(m - 1), np.zeros(max(m - 2, 0))
    wt = np.ones(xb.size)
    live = np.ones(xb.size, bool)
    # The penalty is set for knots of 8 bins or more; a sparse source (an IMU sending a few packets a
    # second: two or three bins a knot) gets it in proportion, or it would straighten a
    # temperature swing that its few bins do show.
    lam = smooth * min(1.0, knot_ns / (8.0 * bin_ns))
    v = np.zeros(m)
    rejected = 0
    for it in range(iters):
        ww = wt * live
        d0 = np.bincount(j, ww * w0 * w0, m) + np.bincount(j + 1, ww * w1 * w1, m) + lam * dtd0 + 1e-12
        d1 = np.bincount(j, ww * w0 * w1, m - 1)[: m - 1] + lam * dtd1
        rhs = np.bincount(j, ww * w0 * yb, m) + np.bincount(j + 1, ww * w1 * yb, m)
        v = _solve_penta(d0, d1, lam * dtd2, rhs)
        r = yb - (v[j] * w0 + v[j + 1] * w1)
        wt = np.where(r <= 0, 1.0, above_weight)
        if it == iters // 2:
            # spread of the good bins: median distance above the curve
            good = live & (r > 0)
            s = float(np.median(r[good])) if good.any() else 0.0
            bad = (r > max(10 * s, 2e6)) | (r < -max(6 * s, early_ns))
            if not bad.all():
                rejected = int(bad.sum())
                live &= ~bad
    return LowerCurve(x0, step, v), {"early_bins": n_early, "rejected_bins": rejected + int(congested.sum())}


def _detrend(xb: np.ndarray, yb: np.ndarray) -> np.ndarray:
    """Residuals of the bins from a straight line through their lower half (the overall drift)."""
    xc = xb - xb.mean()
    d, c = np.polyfit(xc, yb, 1)
    low = yb - (c + d * xc) <= np.median(yb - (c + d * xc))
    if low.sum() >= 2:
        d, c = np.polyfit(xc[low], yb[low], 1)
    return np.asarray(yb - (c + d * xc))


def _too_early(xb: np.ndarray, yb: np.ndarray, bin_ns: float, tol_ns: float, *, skip: np.ndarray | None = None,
               edges: bool = False, resid: np.ndarray | None = None) -> np.ndarray:
    """Bins more than `tol_ns` below a low order statistic of their neighbours on *each* side
    (the `k` bins before and the `k` after that lie within `k + 1` bins of source time: the
    second-lowest, the third from 8 a side): a minimum that no delay explains (packets stamped
    late), however few of them a bin holds. A bin at the edge of a congestion episode is low
    against one side only and is kept. With `edges`, only the bins that have such neighbours on
    one side alone (the ends of an epoch, the edges of a silence, across which the drift
    wandered) are judged, against that side; `skip` marks bins that are nobody's neighbours;
    `resid` is `_detrend(xb, yb)` when the caller has it."""
    k = max(4, int(2e9 // bin_ns))
    j = min(2, k // 4)
    r = _detrend(xb, yb) if resid is None else resid
    if skip is not None:
        r = np.where(skip, np.inf, r)
    pad = np.r_[np.full(k, np.inf), r, np.full(k, np.inf)]
    xp = np.r_[np.full(k, np.inf), xb, np.full(k, np.inf)]
    win = np.lib.stride_tricks.sliding_window_view(pad, 2 * k + 1)
    xw = np.lib.stride_tricks.sliding_window_view(xp, 2 * k + 1)
    nb = np.where(np.abs(xw - xb[:, None]) <= (k + 1) * bin_ns, win, np.inf)
    left = np.partition(nb[:, :k], j, axis=1)[:, j]
    right = np.partition(nb[:, k + 1 :], j, axis=1)[:, j]
    ref = np.minimum(left, right)
    sides = np.isfinite(left) ^ np.isfinite(right) if edges else np.isfinite(left) & np.isfinite(right)
    return np.asarray(sides & (r < ref - tol_ns))


def _congested(xb: np.ndarray, yb: np.ndarray, bin_ns: float, tol_ns: float, window_ns: float,
               resid: np.ndarray | None = None) -> np.ndarray:
    """Bins more than `tol_ns` above the third-lowest bin within +-`window_ns` (after removing
    the overall drift, `resid` = `_detrend(xb, yb)` when the caller has it): a congestion episode
    or a stall, which lifts every delay for seconds."""
    n = xb.size
    k = int(window_ns // bin_ns)
    if n < 8 or k < 1:
        return np.zeros(n, bool)
    r = _detrend(xb, yb) if resid is None else resid
    pad = np.r_[np.full(k, np.inf), r, np.full(k, np.inf)]
    # the floor is the third-lowest bin around: one or two bins of stamped-late packets that got
    # through cannot make every honest bin look congested
    win = np.lib.stride_tricks.sliding_window_view(pad, 2 * k + 1)
    floor = np.partition(win, 2, axis=1)[:, 2] if 2 * k + 1 > 3 else win.min(axis=1)
    return np.asarray(r - floor > tol_ns)
