"""Time-indexed ring buffers, one per stream, in reference-clock nanoseconds.

- `TimeIndexedRing`: fixed-rate streams (audio, IMU) in one contiguous numpy buffer. The
  buffer is *mirrored* (every sample is written at `i % cap` and `i % cap + cap`), so any
  window of up to `capacity` samples is a single contiguous view: window queries never copy
  and never return two pieces. Time <-> sample index goes through per-chunk anchors (the
  chunk's mapped `ref_ns`), so clock drift never accumulates into the index.
- `ObjectRing` (in `object_ring.py`, re-exported here): frames with a sorted time index.

Both accept out-of-order arrivals within `lateness_ns` in place, count what they drop by
reason (`late`, `evicted`, `overrun`, `overlap`, `gap_samples`) and export a fill ratio.
Views returned by `TimeIndexedRing.window` stay valid until `capacity - len(window)` more
samples are appended; copy what you keep longer.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from tristream.core.errors import InvalidPacket
from tristream.core.metrics import DropCounter
from tristream.core.object_ring import ObjectRing

__all__ = ["ObjectRing", "RingWindow", "TimeIndexedRing"]

@dataclass(slots=True)
class RingWindow:
    """A window of a `TimeIndexedRing`: a view of the samples in [t0, t1) that are still held."""

    data: np.ndarray
    start_ns: int
    start_index: int
    missing: int
    clipped: bool

    def __len__(self) -> int:
        return int(self.data.shape[0])


class TimeIndexedRing:
    """Bounded ring of fixed-rate samples; O(1) append per chunk, zero-copy window queries."""

    def __init__(
        self,
        rate_hz: float,
        capacity: int,
        *,
        channels: int = 1,
        dtype: np.dtype | type = np.float32,
        lateness_ns: int = 200_000_000,
        snap_ns: int = 5_000_000,
        anchors: int | None = None,
        name: str = "ring",
    ) -> None:
        if not (rate_hz > 0 and math.isfinite(rate_hz)):
            raise ValueError(f"{name}: rate_hz={rate_hz!r}; expected a positive finite rate")
        if capacity <= 0 or channels <= 0:
            raise ValueError(f"{name}: capacity={capacity}, channels={channels}; both must be positive")
        self.name = name
        self.rate_hz = float(rate_hz)
        self.period_ns = 1e9 / self.rate_hz
        self.capacity = int(capacity)
        self.channels = int(channels)
        self.lateness_ns = int(lateness_ns)
        self.snap = max(0, round(snap_ns / self.period_ns))
        self._snap_lo = -(self.snap + 1) * self.period_ns
        self._snap_hi = self.snap * self.period_ns
        shape = (2 * self.capacity,) if channels == 1 else (2 * self.capacity, channels)
        self._buf = np.zeros(shape, dtype=dtype)
        # The buffer as one flat memoryview: an in-order chunk of the buffer's dtype is copied
        # into both halves by two memoryview slice stores, which cost 60 % of numpy's slice
        # assignments per call (a chunk of another dtype goes the numpy way, which converts it).
        self._flat: Any = self._buf.reshape(-1).data
        self._half = self.capacity * self.channels
        # One anchor per chunk at worst (noisy timestamps); by default enough for chunks of 64+ samples.
        self._acap = max(16, int(anchors) if anchors is not None else self.capacity // 64 + 16)
        self._at: list[int] = []  # anchor times (ref ns), ascending; live range [_a0, _a1)
        self._ai: list[int] = []  # anchor sample indices
        self._a0 = 0
        self._a1 = 0
        self._last_t = 0
        self._last_i = 0
        self._gaps: list[list[int]] = []  # open gaps [start, end, counted] (absolute sample indices)
        # gaps already counted (older than the lateness bound), in order, until they leave the ring
        self._settled: deque[list[int]] = deque()
        self.head = 0  # absolute index one past the newest sample
        self.read_index = 0
        self._reader = False
        self.high_water = 0.0
        self._ndim = 1 if channels == 1 else 2
        self.anchor_tol_ns = self.period_ns / 4
        self._overrun = 0
        self._counts = DropCounter(name)

    # ------------------------------------------------------------------ properties
    @property
    def counts(self) -> DropCounter:
        """Counters by reason: evicted, overrun, late, overlap, gap_samples, filled_late (samples)."""
        out = DropCounter(self.name)
        out.merge(self._counts)
        if self.head > self.capacity:  # every slot that left the ring (gap zeros included)
            out.add("evicted", self.head - self.capacity)
        if self._overrun:
            out.add("overrun", self._overrun)
        return out

    @property
    def tail(self) -> int:
        """Absolute index of the oldest sample still held."""
        return max(0, self.head - self.capacity)

    @property
    def size(self) -> int:
        """Number of samples held."""
        return self.head - self.tail

    @property
    def fill_ratio(self) -> float:
        """Unread samples over capacity when a reader consumes, else held samples over capacity."""
        start = max(self.read_index, self.tail) if self._reader else self.tail
        return (self.head - start) / self.capacity

    @property
    def newest_ns(self) -> int | None:
        """Reference time one sample period after the newest sample (None when empty)."""
        return None if self._a1 == self._a0 else self.time_at(self.head)

    # ------------------------------------------------------------------ index <-> time
    def time_at(self, index: int) -> int:
        """Reference ns of absolute sample `index` (extrapolated from the nearest anchor)."""
        if self._a1 == self._a0:
            raise InvalidPacket(f"{self.name}: ring is empty; append a chunk first")
        if index >= self._last_i:
            return self._last_t + round((index - self._last_i) * self.period_ns)
        k = max(bisect.bisect_right(self._ai, index, self._a0, self._a1) - 1, self._a0)
        return self._at[k] + round((index - self._ai[k]) * self.period_ns)

    def index_at(self, t_ns: int) -> int:
        """Absolute index of the first sample whose time is >= `t_ns`."""
        if self._a1 == self._a0:
            raise InvalidPacket(f"{self.name}: ring is empty; append a chunk first")
        if t_ns >= self._last_t:
            return self._last_i + math.ceil((t_ns - self._last_t) / self.period_ns - 1e-9)
        k = max(bisect.bisect_right(self._at, t_ns, self._a0, self._a1) - 1, self._a0)
        return self._ai[k] + math.ceil((t_ns - self._at[k]) / self.period_ns - 1e-9)

    def _add_anchor(self, t_ns: int, index: int) -> None:
        self._at.append(t_ns)
        self._ai.append(index)
        self._a1 += 1
        self._last_t = t_ns
        self._last_i = index
        if self._a1 - self._a0 > self._acap:
            self._a0 += 1
            if self._a0 >= self._acap:  # amortised O(1) compaction
                del self._at[: self._a0]
                del self._ai[: self._a0]
                self._a1 -= self._a0
                self._a0 = 0

    # ------------------------------------------------------------------ writing
    def _write(self, pos: int, data: np.ndarray) -> None:
        cap = self.capacity
        n = data.shape[0]
        p = pos % cap
        first = min(n, cap - p)
        self._buf[p : p + first] = data[:first]
        self._buf[p + cap : p + cap + first] = data[:first]
        if first < n:
            rest = n - first
            self._buf[:rest] = data[first:]
            self._buf[cap : cap + rest] = data[first:]

    def _after_advance(self, old_head: int) -> None:
        """Bookkeeping of the hot path once `head` moved on from `old_head`."""
        cap = self.capacity
        head = self.head
        tail = head - cap if head > cap else 0
        start = tail
        if self._reader:
            if self.read_index < tail:
                self._overrun += tail - max(self.read_index, old_head - cap if old_head > cap else 0)
                self.read_index = tail
            start = self.read_index
        fill = (head - start) / cap  # `fill_ratio`
        if fill > self.high_water:
            self.high_water = fill
        gaps = self._gaps
        if gaps:
            horizon = head - round(self.lateness_ns / self.period_ns)
            for g in gaps:
                if g[1] <= horizon:
                    self._settle_gaps()
                    return
            settled = self._settled
            while settled and settled[0][1] <= tail:
                settled.popleft()

    def _advance_head(self, new_head: int) -> None:
        cap = self.capacity
        old_tail = self.head - cap if self.head > cap else 0
        self.head = new_head
        evicted = (new_head - cap if new_head > cap else 0) - old_tail
        if evicted > 0:
            if self._reader and self.read_index < self.tail:
                self._overrun += min(evicted, self.tail - self.read_index)
                self.read_index = self.tail
        fill = self.fill_ratio
        if fill > self.high_water:
            self.high_water = fill
        if self._gaps:
            self._settle_gaps()

    def _settle_gaps(self) -> None:
        horizon = self.head - round(self.lateness_ns / self.period_ns)
        keep = []
        for g in self._gaps:
            if g[1] <= horizon:
                if not g[2]:
                    self._counts.add("gap_samples", g[1] - g[0])
                    g[2] = 1
                self._settled.append(g)
            else:
                keep.append(g)
        self._gaps = keep
        tail = self.tail
        settled = self._settled
        while settled and settled[0][1] <= tail:
            settled.popleft()

    def append(self, t_ns: int, samples: np.ndarray) -> int:
        """Add a chunk whose first sample was captured at reference time `t_ns`.

        Returns the absolute index of its first sample, or -1 when the chunk was dropped
        (counted as `late`). A chunk within `snap_ns` of the expected position joins
        contiguously; a later one leaves a zero-filled gap (counted in `gap_samples` unless a
        late chunk fills it within `lateness_ns`); an earlier one fills gaps only (the rest is
        counted as `overlap`).
        """
        # Hot path: an in-order chunk that continues the stream contiguously (within snap).
        if type(samples) is np.ndarray and samples.ndim == self._ndim and self._a1 and t_ns >= self._last_t:
            head = self.head
            exact = self._last_t + (head - self._last_i) * self.period_ns
            d = t_ns - exact
            n = samples.shape[0]
            cap = self.capacity
            if self._snap_lo < d <= self._snap_hi and 0 < n <= cap and (
                self._ndim == 1 or samples.shape[1] == self.channels
            ):
                p = head % cap
                if p + n <= cap:
                    ch = self.channels
                    src = samples if ch == 1 else samples.reshape(-1)
                    a = p * ch
                    b = a + n * ch
                    half = self._half
                    try:
                        self._flat[a:b] = src  # (refused, before writing, for another dtype)
                        self._flat[a + half : b + half] = src
                    except (ValueError, TypeError, NotImplementedError):
                        buf = self._buf
                        buf[p : p + n] = samples
                        buf[p + cap : p + cap + n] = samples
                else:
                    self._write(head, samples)
                if d > self.anchor_tol_ns or d < -self.anchor_tol_ns:
                    self._add_anchor(int(t_ns), head)
                self.head = head + n
                if self._reader or self._gaps or head + n <= cap:
                    self._after_advance(head)
                return head
        return self._append_checked(t_ns, samples if isinstance(samples, np.ndarray) else np.asarray(samples))

    def _append_checked(self, t_ns: int, data: np.ndarray) -> int:
        if data.ndim == 0 or (self.channels == 1 and data.ndim != 1) or (
            self.channels > 1 and (data.ndim != 2 or data.shape[1] != self.channels)
        ):
            want = "(n,)" if self.channels == 1 else f"(n, {self.channels})"
            raise InvalidPacket(f"{self.name}: chunk shape {data.shape}; expected {want}")
        n = int(data.shape[0])
        if n == 0:
            raise InvalidPacket(f"{self.name}: chunk has 0 samples; expected at least one")
        t_ns = int(t_ns)
        if self._a1 == self._a0:
            self._add_anchor(t_ns, 0)
            return self._append_at(0, data)
        pos = self.index_at(t_ns)
        if abs(pos - self.head) <= self.snap:
            pos = self.head
        if pos >= self.head:
            if pos > self.head:
                gap = pos - self.head
                zeros_from = max(self.head, pos - self.capacity)
                if pos > zeros_from:
                    self._write(zeros_from, np.zeros((pos - zeros_from,) + data.shape[1:], self._buf.dtype))
                self._gaps.append([self.head, pos, 0])
                if gap > self.capacity:
                    self._counts.add("gap_samples", gap - self.capacity)
            self._add_anchor(t_ns, pos)
            return self._append_at(pos, data)
        return self._append_late(pos, t_ns, data)

    def _append_at(self, pos: int, data: np.ndarray) -> int:
        n = data.shape[0]
        if n > self.capacity:  # only the newest `capacity` samples fit; _advance_head counts the rest
            self._write(pos + n - self.capacity, data[n - self.capacity :])
        else:
            self._write(pos, data)
        self._advance_head(pos + n)
        return pos

    def _append_late(self, pos: int, t_ns: int, data: np.ndarray) -> int:
        n = data.shape[0]
        newest = self.time_at(self.head)
        if t_ns < newest - self.lateness_ns or pos + n <= self.tail:
            self._counts.add("late", n)
            return -1
        written = 0
        keep: list[list[int]] = []
        # settled gaps that this chunk reaches (only the newest can be) go back to the open ones
        back: list[list[int]] = []
        while self._settled and self._settled[-1][1] > pos:
            back.append(self._settled.pop())
        for g in back[::-1] + self._gaps:
            lo, hi = max(g[0], pos, self.tail), min(g[1], pos + n)
            if lo >= hi:
                keep.append(g)
                continue
            self._write(lo, data[lo - pos : hi - pos])
            written += hi - lo
            if g[0] < lo:
                keep.append([g[0], lo, g[2]])
            if hi < g[1]:
                keep.append([hi, g[1], g[2]])
        self._gaps = keep
        if written < n:
            self._counts.add("overlap", n - written)
        if written:
            self._counts.add("filled_late", written)
        return pos

    # ------------------------------------------------------------------ reading
    def window_index(self, i0: int, i1: int) -> np.ndarray:
        """View of samples [i0, i1) (absolute indices), clipped to what is held."""
        i0 = max(i0, self.tail)
        i1 = min(i1, self.head)
        if i1 <= i0:
            return self._buf[:0]
        p = i0 % self.capacity
        return self._buf[p : p + (i1 - i0)]

    def window(self, t0_ns: int, t1_ns: int) -> RingWindow:
        """Samples captured in [t0, t1): a zero-copy view plus how many are gap-filled zeros."""
        if t1_ns < t0_ns:
            raise InvalidPacket(f"{self.name}: window [{t0_ns}, {t1_ns}) ends before it starts")
        if self._a1 == self._a0:
            return RingWindow(self._buf[:0], int(t0_ns), 0, 0, True)
        i0, i1 = self.index_at(t0_ns), self.index_at(t1_ns)
        head = self.head
        tail = head - self.capacity if head > self.capacity else 0
        c0 = i0 if i0 > tail else tail
        c1 = i1 if i1 < head else head
        if c1 <= c0:
            return RingWindow(self._buf[:0], int(t0_ns), c0, 0, True)
        missing = 0
        for g in itertools.chain(self._settled, self._gaps):
            missing += max(0, min(g[1], c1) - max(g[0], c0))
        p = c0 % self.capacity
        return RingWindow(self._buf[p : p + (c1 - c0)], self.time_at(c0), c0, missing, c0 != i0 or c1 != i1)

    def latest_at_or_before(self, t_ns: int) -> tuple[int, np.ndarray] | None:
        """(time, sample view) of the newest held sample captured at or before `t_ns`."""
        if self._a1 == self._a0:
            return None
        i = min(self.index_at(t_ns + 1), self.head) - 1
        if i < self.tail:
            return None
        p = i % self.capacity
        return self.time_at(i), self._buf[p]

    def consume_until(self, t_ns: int) -> None:
        """Mark everything captured before `t_ns` as read (drives `fill_ratio` and `overrun`)."""
        self._reader = True
        if self._a1 != self._a0:
            self.read_index = min(self.head, max(self.read_index, self.index_at(t_ns)))
