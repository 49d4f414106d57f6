"""Vectorised bookkeeping of one source's recording in arrival order: wraps, duplicates, epochs, gaps.

- `unwrap`: a wrapping timestamp (32-bit RTP, 33-bit PTS) is placed in the cycle nearest its
  predecessor in arrival order, so a wrap moves nothing; what remains a jump is a reset.
- `duplicates`: the same capture (same start and end) arriving again within `window_ns`.
- `segment_epochs`: a reset moves `y = arrival - source time` by an amount no delay explains.
  A running median of y over 7 packets ignores spikes, stragglers and reordering; where it
  jumps by more than `jump_ns`, a segment starts. A segment up to `max_delay_ns` above its
  epoch that is short or drains back to the epoch's level is a delay excursion (a stall) and
  stays in the epoch; one that
  returns to an earlier epoch's level rejoins it; any other starts a new epoch (a *reset*).
  Packets far from their segment's median are placed with the epoch whose level they match
  (late packets of the previous epoch), as delayed (above it), or as outliers (impossibly
  early, or a segment too short to confirm).
- `gaps`: holes in an epoch's source timeline (lost packets, a silent sensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def unwrap(values: np.ndarray, wrap: float) -> tuple[np.ndarray, np.ndarray]:
    """Unwrap `values` (in arrival order) of a timestamp that wraps every `wrap`; returns (values, cycle)."""
    if not wrap or values.size < 2:
        return values, np.zeros(values.size, np.int64)
    d = np.diff(values)
    # a step of at most 0.4 wrap divides to less than half a cycle: only the others are divided,
    # and the cycle is constant between them (each stretch shifted by one rint(cycle * wrap))
    at = np.flatnonzero(np.abs(d) > 0.4 * wrap)
    step = -np.rint(d[at] / wrap).astype(np.int64)
    at, step = at[step != 0], step[step != 0]
    if not at.size:
        return values, np.zeros(values.size, np.int64)
    level = np.r_[np.int64(0), np.cumsum(step)]
    length = np.diff(np.r_[0, at + 1, values.size])
    return values + np.repeat(np.rint(level * wrap).astype(np.int64), length), np.repeat(level, length)


def duplicates(start: np.ndarray, end: np.ndarray, arrival: np.ndarray, window_ns: int,
               order: np.ndarray | None = None) -> np.ndarray:
    """For packets in arrival order: index of the original each one duplicates, or -1. `order`
    is `np.argsort(start, kind="stable")` when the caller has it."""
    n = start.size
    out = np.full(n, -1, np.int64)
    if n < 2:
        return out
    if order is None:
        order = np.argsort(start, kind="stable")  # stable: equal starts stay in arrival order
    s = start[order]
    at = np.flatnonzero(s[1:] == s[:-1])  # the few equal starts: the ends and arrivals there
    prev, this = order[at], order[at + 1]
    k = at[(end[this] == end[prev]) & (arrival[this] - arrival[prev] <= window_ns)] + 1
    if not k.size:
        return out
    # the original of a run of copies (consecutive in start order) is the packet before its first copy
    head = np.maximum.accumulate(np.where(np.r_[True, np.diff(k) != 1], k - 1, 0))
    out[order[k]] = order[head]
    return out


# A sorting network for 7 values (16 compare-exchanges; it sorts every 0/1 input, hence every input),
# pruned to what the middle value needs: per compare-exchange, whether its low and its high output
# is read later on the way to position 3 (22 of the 32 minima and maxima)
_NET7 = ((0, 6), (2, 3), (4, 5), (0, 2), (1, 4), (3, 6), (0, 1), (2, 5), (3, 4), (1, 2), (4, 6), (2, 3), (4, 5),
         (1, 2), (3, 4), (5, 6))


def _median_plan(net: tuple[tuple[int, int], ...], mid: int) -> tuple[tuple[int, int, bool, bool], ...]:
    need = {mid}
    plan = []
    for a, b in reversed(net):
        lo, hi = a in need, b in need
        if lo or hi:
            plan.append((a, b, lo, hi))
            need |= {a, b}
    return tuple(reversed(plan))


_MED7 = _median_plan(_NET7, 3)


def _median7(y: np.ndarray) -> np.ndarray:
    """The middle value of every 7 consecutive values of `y` (n - 6 of them), elementwise over 7
    shifted views, `_CHUNK` values at a time (the network's 22 passes then stay in cache: over a
    whole hour's 360,000 values each pass streams three arrays through memory, 5x the time)."""
    m = y.size - 6
    if m <= _CHUNK:
        return _median7_chunk(y)
    out = np.empty(m, y.dtype)
    for a in range(0, m, _CHUNK):
        b = min(m, a + _CHUNK)
        out[a:b] = _median7_chunk(y[a : b + 6])
    return out


_CHUNK = 1 << 14


def _median7_chunk(y: np.ndarray) -> np.ndarray:
    """`_median7` of one chunk; each value the network writes goes into an array of its own or a
    freed one (a fresh array per minimum and maximum costs 60 % more)."""
    m = y.size - 6
    c = [y[k : m + k] for k in range(7)]
    own = [False] * 7  # c[k] is an array of this function's (not a view of y)
    spare: list[np.ndarray] = []
    for a, b, lo, hi in _MED7:
        if lo and hi:
            low = np.minimum(c[a], c[b], out=spare.pop() if spare else None)
            c[b] = np.maximum(c[a], c[b], out=c[b] if own[b] else None)
            own[b] = True
            if own[a]:
                spare.append(c[a])
            c[a] = low
            own[a] = True
        elif lo:
            c[a] = np.minimum(c[a], c[b], out=c[a] if own[a] else None)
            own[a] = True
        else:
            c[b] = np.maximum(c[a], c[b], out=c[b] if own[b] else None)
            own[b] = True
    return c[3]


def running_median(y: np.ndarray, width: int = 7) -> np.ndarray:
    """Centred running median (edges use the nearest full window)."""
    n = y.size
    if n <= width:
        return np.full(n, np.median(y) if n else 0, dtype=y.dtype)
    if width == 7 and not (y.dtype.kind == "f" and np.isnan(y).any()):
        # the windows' middle values by the network over 7 shifted views, elementwise: the same
        # values as a partition of every window, in a quarter of the time
        med = _median7(y)
    else:
        win = np.lib.stride_tricks.sliding_window_view(y, width)
        med = np.partition(win, width // 2, axis=1)[:, width // 2]
    h = width // 2
    return np.r_[np.full(h, med[0]), med, np.full(n - med.size - h, med[-1])]


@dataclass(slots=True)
class Epochs:
    """Per packet (arrival order): epoch label (-1 outlier), and per-epoch segment levels."""

    label: np.ndarray
    count: int
    delayed: int
    stragglers: int


def segment_epochs(y: np.ndarray, arrival: np.ndarray, *, jump_ns: float = 200e6, max_delay_ns: float = 2e9,
                   confirm: int = 3) -> Epochs:
    """Label packets (arrival order, duplicates removed) with their epoch; see the module docstring."""
    n = y.size
    label = np.zeros(n, np.int64)
    if n == 0:
        return Epochs(label, 0, 0, 0)
    med = running_median(y)
    cut = np.flatnonzero(np.abs(np.diff(med)) > jump_ns) + 1
    bounds = np.r_[0, cut, n]
    levels: list[float] = []  # per epoch: its level at the end of its latest level segment
    ends: list[int] = []  # arrival of that end
    cur = -1
    delayed = stragglers = 0
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        lv0, lv1 = float(med[a]), float(med[b - 1])
        if cur >= 0:
            d = lv0 - levels[cur]
            if abs(d) <= jump_ns:
                label[a:b] = cur
                levels[cur], ends[cur] = lv1, int(arrival[b - 1])
                continue
            back = float(med[a:b].min()) - levels[cur] <= jump_ns  # the excursion drained
            if 0 < d <= max_delay_ns and (back or arrival[b - 1] - arrival[a] <= max_delay_ns):
                label[a:b] = cur  # a delay excursion (a stall): stays with its epoch
                delayed += b - a
                if abs(lv1 - levels[cur]) <= jump_ns:
                    levels[cur], ends[cur] = lv1, int(arrival[b - 1])
                continue
            match = [e for e in range(len(levels)) if abs(lv0 - levels[e]) <= jump_ns]
            if match:
                cur = match[-1]
                label[a:b] = cur
                levels[cur], ends[cur] = lv1, int(arrival[b - 1])
                continue
            if b - a < confirm:
                label[a:b] = -1
                continue
        levels.append(lv1)
        ends.append(int(arrival[b - 1]))
        cur = len(levels) - 1
        label[a:b] = cur
    # Packets far from their segment's median: late packets of another epoch, delayed, or outliers.
    far = np.flatnonzero((np.abs(y - med) > jump_ns) & (label >= 0))
    if far.size and len(levels) > 1:
        lv = np.array(levels)
        for i in far.tolist():
            k = int(np.argmin(np.abs(lv - y[i])))
            if abs(lv[k] - y[i]) <= jump_ns and k != label[i]:
                label[i] = k
                stragglers += 1
    far = np.flatnonzero((y - med < -jump_ns) & (label >= 0))
    if far.size:
        lv_of = np.array(levels)[label[far]]
        bad = y[far] < lv_of - jump_ns
        label[far[bad]] = -1
    return Epochs(label, len(levels), delayed, stragglers)


def gaps(start: np.ndarray, end: np.ndarray) -> tuple[int, int, float]:
    """Holes in one epoch's source timeline: (gaps, packets lost, period ns).

    Spans (audio chunks, sensor blocks) leave a hole when a start lies more than half a span
    after the previous end; instantaneous packets (frames) when the step exceeds 1.5 periods.
    """
    o = np.argsort(start, kind="stable")
    return sorted_gaps(start[o], end[o])


def sorted_gaps(s: np.ndarray, e: np.ndarray) -> tuple[int, int, float]:
    """`gaps` of packets already in order of start (stable: equal starts in arrival order)."""
    if s.size < 3:
        return 0, 0, 0.0
    d = np.diff(s)
    d = d[d > 0]
    if d.size == 0:
        return 0, 0, 0.0
    period = float(np.median(d))
    span = float(np.median(e - s))
    if span > 0:
        hole = s[1:] - e[:-1]
        big = hole > 0.5 * span
        lost = np.rint(hole[big] / period)
    else:
        big = d > 1.5 * period
        lost = np.rint(d[big] / period) - 1
    return int(big.sum()), int(np.maximum(lost, 1).sum()), period
