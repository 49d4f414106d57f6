"""`ObjectRing`: a bounded, time-sorted ring of objects (video frames) in reference ns.

Out-of-order arrivals within `lateness_ns` land in place; older ones are counted `late`.
Queries: latest-at-or-before (as-of), nearest, window [t0, t1). Fill ratio, high-water mark,
eviction/overrun counters as for `TimeIndexedRing`.
"""

from __future__ import annotations

import bisect
from typing import Generic, TypeVar

from tristream.core.metrics import DropCounter

T = TypeVar("T")


class ObjectRing(Generic[T]):
    """Bounded, time-sorted ring of objects (video frames); out-of-order within lateness lands in place."""

    def __init__(self, capacity: int, *, lateness_ns: int = 200_000_000, name: str = "frames") -> None:
        if capacity <= 0:
            raise ValueError(f"{name}: capacity={capacity}; expected a positive number of items")
        self.name = name
        self.capacity = int(capacity)
        self.lateness_ns = int(lateness_ns)
        self._t: list[int] = []
        self._v: list[T] = []
        self._s = 0
        self._newest: int | None = None
        self._read: int | None = None
        self.high_water = 0.0
        self.counts = DropCounter(name)

    def __len__(self) -> int:
        return len(self._t) - self._s

    @property
    def fill_ratio(self) -> float:
        """Held (or, once a reader consumes, unread) items over capacity."""
        if self._read is None:
            return len(self) / self.capacity
        lo = bisect.bisect_left(self._t, self._read, lo=self._s)
        return (len(self._t) - lo) / self.capacity

    @property
    def newest_ns(self) -> int | None:
        """Largest time appended so far."""
        return self._newest

    def append(self, t_ns: int, item: T) -> bool:
        """Insert `item` at time `t_ns`; False (counted `late`) if older than the lateness bound."""
        t_ns = int(t_ns)
        newest = self._newest
        if newest is not None and t_ns < newest - self.lateness_ns:
            self.counts.add("late")
            return False
        ts = self._t
        s = self._s
        n = len(ts) - s
        cap = self.capacity
        if n and t_ns < ts[s] and n >= cap:
            self.counts.add("late")
            return False
        if not ts or t_ns >= ts[-1]:
            ts.append(t_ns)
            self._v.append(item)
        else:
            self.counts.add("reordered")
            k = bisect.bisect_right(ts, t_ns, lo=s)
            ts.insert(k, t_ns)
            self._v.insert(k, item)
        if newest is None or t_ns > newest:
            self._newest = t_ns
        n += 1
        if n > cap:
            if self._read is not None and ts[s] >= self._read:
                self.counts.add("overrun")
            self.counts.add("evicted")
            self._s = s = s + 1
            n -= 1
            if s > cap:
                del ts[:s]
                del self._v[:s]
                self._s = 0
        fill = n / cap if self._read is None else self.fill_ratio
        if fill > self.high_water:
            self.high_water = fill
        return True

    def latest_at_or_before(self, t_ns: int) -> tuple[int, T] | None:
        """(time, item) of the newest item at or before `t_ns` (as-of lookup)."""
        k = bisect.bisect_right(self._t, t_ns, lo=self._s) - 1
        return None if k < self._s else (self._t[k], self._v[k])

    def nearest(self, t_ns: int) -> tuple[int, T] | None:
        """(time, item) closest to `t_ns` (ties go to the earlier item)."""
        k = bisect.bisect_left(self._t, t_ns, lo=self._s)
        best: tuple[int, T] | None = None
        for j in (k - 1, k):
            if self._s <= j < len(self._t) and (best is None or abs(self._t[j] - t_ns) < abs(best[0] - t_ns)):
                best = (self._t[j], self._v[j])
        return best

    def window(self, t0_ns: int, t1_ns: int) -> list[tuple[int, T]]:
        """Items with time in [t0, t1), in time order."""
        lo = bisect.bisect_left(self._t, t0_ns, lo=self._s)
        hi = bisect.bisect_left(self._t, t1_ns, lo=lo)
        return list(zip(self._t[lo:hi], self._v[lo:hi], strict=True))

    def items(self) -> list[tuple[int, T]]:
        """Every held item in time order."""
        return list(zip(self._t[self._s :], self._v[self._s :], strict=True))

    def consume_until(self, t_ns: int) -> None:
        """Mark items before `t_ns` as read (drives `fill_ratio` and `overrun`)."""
        self._read = t_ns if self._read is None else max(self._read, t_ns)
