"""Cross-modal joins over reference time: interval join, as-of join, approximate-time sets.

Every join is event-driven: `push(stream, ref_ns, item, now_ns)` adds data and returns the
windows that became *complete* - decided only from data the watermarks guarantee is final, so
the output does not depend on arrival order within the lateness bound. `poll(now_ns)` lets
idleness timeouts advance a join without new data; `flush()` ends every stream.

Each result is an `AlignedWindow` with its members, `skew_ns` (max - min reference time of its
members) and the streams that were `missing`. Late data is counted (`late:<stream>`), as is
data no window could use (`unmatched:<stream>`), never dropped silently. `ApproximateTimeSync`
(N streams, minimal-spread sets) lives in `sync.py`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from tristream.core.metrics import DropCounter
from tristream.core.watermark import POS_INF, WatermarkTracker

Member = tuple[int, Any]


@dataclass(slots=True)
class AlignedWindow:
    """One aligned result: stream -> members (time, item), its skew and the missing streams."""

    anchor_ns: int
    members: dict[str, list[Member]] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    skew_ns: int = 0

    def finish(self) -> AlignedWindow:
        times = [t for ms in self.members.values() for t, _ in ms]
        self.skew_ns = max(times) - min(times) if times else 0
        return self


class _Queues:
    """Per-stream time-sorted queues plus the watermark tracker shared by the joins."""

    def __init__(self, streams: list[str], lateness_ns: int, idle_timeout_ns: int, name: str) -> None:
        if len(set(streams)) != len(streams) or not streams:
            raise ValueError(f"{name}: streams {streams!r} must be distinct and non-empty")
        self.streams = list(streams)
        self.wm = WatermarkTracker(lateness_ns, idle_timeout_ns)
        for s in streams:
            self.wm.add_stream(s)
        self.t: dict[str, list[int]] = {s: [] for s in streams}
        self.v: dict[str, list[Any]] = {s: [] for s in streams}
        self.counts = DropCounter(name)
        self.now = -POS_INF
        self.flushed = False

    def push(self, stream: str, ref_ns: int, item: Any, now_ns: int) -> bool:
        if stream not in self.t:
            raise KeyError(f"unknown stream {stream!r}; this join was built for {self.streams}")
        self.now = max(self.now, now_ns)
        if not self.wm.observe(stream, ref_ns, now_ns):
            self.counts.add(f"late:{stream}")
            return False
        ts = self.t[stream]
        k = bisect.bisect_right(ts, ref_ns)
        ts.insert(k, ref_ns)
        self.v[stream].insert(k, item)
        return True

    def horizon(self) -> int:
        return POS_INF if self.flushed else self.wm.combined(self.now)

    def pop_until(self, stream: str, t_ns: int, reason: str | None) -> list[Member]:
        """Remove members with time <= t_ns; count them under `reason` (unless None)."""
        ts = self.t[stream]
        if not ts or ts[0] > t_ns:
            return []
        k = bisect.bisect_right(ts, t_ns)
        out = list(zip(ts[:k], self.v[stream][:k], strict=True))
        del ts[:k]
        del self.v[stream][:k]
        if reason and out:
            self.counts.add(f"{reason}:{stream}", len(out))
        return out


class _QueuedJoin:
    """Shared driving of the joins over `_Queues`: idleness polls and end of input; subclasses emit."""

    q: _Queues

    def poll(self, now_ns: int) -> list[AlignedWindow]:
        """Advance processing time (idleness) without new data."""
        self.q.now = max(self.q.now, now_ns)
        return self._emit()

    def flush(self) -> list[AlignedWindow]:
        """End of input: emit every pending window."""
        self.q.flushed = True
        return self._emit()

    def _emit(self) -> list[AlignedWindow]:
        raise NotImplementedError


class _RightStreamJoin(_QueuedJoin):
    """A two-sided join whose right items (frames) queue in `q`."""

    right: str

    def push(self, ref_ns: int, item: Any, now_ns: int) -> list[AlignedWindow]:
        """Add a right item (frame); returns windows completed so far."""
        self.q.push(self.right, ref_ns, item, now_ns)
        return self._emit()


class IntervalJoin(_RightStreamJoin):
    """Join each segment of `left` (e.g. a VAD speech segment) with the `right` items overlapping it.

    Push segments with `push_segment(start, end, item, now)` (usually when the segment ends, so
    its start lies in the past) and right items (frames) with `push(ref_ns, item, now)`. A
    segment completes once the right stream's watermark passes `end + after_ns`; its window holds
    the frames in [start - before_ns, end + after_ns]. Frames are retained for `retention_ns`
    behind the watermark; a segment reaching further back than that is counted `truncated`.
    """

    def __init__(self, right: str = "video", *, before_ns: int = 0, after_ns: int = 0,
                 retention_ns: int = 30_000_000_000, lateness_ns: int = 100_000_000,
                 idle_timeout_ns: int = 500_000_000) -> None:
        self.right = right
        self.before_ns = int(before_ns)
        self.after_ns = int(after_ns)
        self.retention_ns = int(retention_ns)
        self.q = _Queues([right], lateness_ns, idle_timeout_ns, "interval_join")
        self.counts = self.q.counts
        self._segs: list[tuple[int, int, Any]] = []
        self._released_until = -POS_INF

    def push_segment(self, start_ns: int, end_ns: int, item: Any, now_ns: int) -> list[AlignedWindow]:
        """Add a left segment [start, end]; returns windows completed so far."""
        if end_ns < start_ns:
            raise ValueError(f"segment ends ({end_ns}) before it starts ({start_ns})")
        if start_ns - self.before_ns <= self._released_until:
            self.counts.add("truncated")
        bisect.insort(self._segs, (start_ns, end_ns, item), key=lambda s: (s[0], s[1]))
        self.q.now = max(self.q.now, now_ns)
        return self._emit()

    def _emit(self) -> list[AlignedWindow]:
        h = self.q.horizon()
        out: list[AlignedWindow] = []
        ts, vs = self.q.t[self.right], self.q.v[self.right]
        while self._segs and self._segs[0][1] + self.after_ns <= h:
            start, end, item = self._segs.pop(0)
            lo, hi = start - self.before_ns, end + self.after_ns
            a, b = bisect.bisect_left(ts, lo), bisect.bisect_right(ts, hi)
            frames = list(zip(ts[a:b], vs[a:b], strict=True))
            win = AlignedWindow(anchor_ns=start, members={"segment": [(start, item), (end, item)]})
            if frames:
                win.members[self.right] = frames
            win.missing = () if frames else (self.right,)
            out.append(win.finish())
        if h < POS_INF:
            floor = h - self.retention_ns
            if self._segs:
                floor = min(floor, self._segs[0][0] - self.before_ns)
            k = bisect.bisect_left(ts, floor)
            if k:
                self._released_until = max(self._released_until, ts[k - 1])
                del ts[:k]
                del vs[:k]
        return out


class AsOfJoin(_RightStreamJoin):
    """For each `left` event at t, the latest `right` item at or before t (within `tolerance_ns`).

    A left event completes once the right watermark passes t (no earlier frame can still come);
    its window has skew t - frame time, or the right stream listed as missing. Frames are kept
    while a pending or still-possible query could pick them, and at most `retention_ns`.
    """

    def __init__(self, right: str = "video", *, tolerance_ns: int = 100_000_000,
                 retention_ns: int = 30_000_000_000, lateness_ns: int = 100_000_000, idle_timeout_ns: int = 500_000_000) -> None:
        self.right = right
        self.tolerance_ns = int(tolerance_ns)
        self.retention_ns = int(retention_ns)
        self.q = _Queues([right], lateness_ns, idle_timeout_ns, "asof_join")
        self.counts = self.q.counts
        self._left: list[tuple[int, Any]] = []
        self._left_wm = WatermarkTracker(lateness_ns, idle_timeout_ns)

    def push_left(self, ref_ns: int, item: Any, now_ns: int) -> list[AlignedWindow]:
        """Add a query event (e.g. a token or a speech end) at `ref_ns`.

        Queries may arrive out of order within the lateness bound; an older one is still
        answered but counted as `late:query` (its frame may already be released).
        """
        if not self._left_wm.observe("query", ref_ns, now_ns):
            self.counts.add("late:query")
        bisect.insort(self._left, (ref_ns, item), key=lambda x: x[0])
        self.q.now = max(self.q.now, now_ns)
        return self._emit()

    def _emit(self) -> list[AlignedWindow]:
        h = self.q.horizon()
        out = []
        ts, vs = self.q.t[self.right], self.q.v[self.right]
        while self._left and self._left[0][0] <= h:
            t, item = self._left.pop(0)
            k = bisect.bisect_right(ts, t) - 1
            win = AlignedWindow(anchor_ns=t, members={"query": [(t, item)]})
            if k >= 0 and t - ts[k] <= self.tolerance_ns:
                win.members[self.right] = [(ts[k], vs[k])]
            else:
                win.missing = (self.right,)
            out.append(win.finish())
        if h < POS_INF:  # frames stay reusable: release only those no pending query can pick
            floor = min(self._left[0][0] if self._left else h, self._left_wm.combined(self.q.now)) - self.tolerance_ns
            floor = max(floor, h - self.retention_ns)  # bounded memory even if no query ever comes
            k = bisect.bisect_left(ts, floor) - 1
            if k > 0:
                del ts[:k]
                del vs[:k]
        return out
