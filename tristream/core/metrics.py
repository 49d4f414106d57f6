"""Metrics primitives: counters with reasons and a log-linear latency histogram.

- `DropCounter`: named counts keyed by reason (`late`, `evicted`, `invalid_unit`, ...) so that
  nothing is dropped without a counter saying why.
- `LatencyHistogram`: HdrHistogram-style log-linear buckets over integer nanoseconds, numpy
  backed; O(1) `record`, vectorised `record_many`, P50/P95/P99/max, `merge`. Relative error of a
  percentile is at most 2**-(sub_bucket_bits-1) (0.8 % with the default 8 bits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np


class DropCounter:
    """Counts of events by reason, e.g. `drops.add("late")`; `total` sums every reason.

    Not thread-safe by design (one owner per counter); merge snapshots to aggregate.
    """

    __slots__ = ("_counts", "name")

    def __init__(self, name: str = "drops") -> None:
        self.name = name
        self._counts: dict[str, int] = {}

    def add(self, reason: str, n: int = 1) -> None:
        """Add `n` (>= 0) to the count for `reason`."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot add a negative count ({n}) for reason {reason!r}")
        self._counts[reason] = self._counts.get(reason, 0) + n

    def __getitem__(self, reason: str) -> int:
        return self._counts.get(reason, 0)

    def __iter__(self) -> Iterator[str]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)

    @property
    def total(self) -> int:
        """Sum over all reasons."""
        return sum(self._counts.values())

    def snapshot(self) -> dict[str, int]:
        """A copy of the counts, sorted by reason (for JSON and reports)."""
        return dict(sorted(self._counts.items()))

    def merge(self, other: DropCounter | dict[str, int]) -> None:
        """Add another counter's (or a snapshot's) counts into this one."""
        items = other.snapshot().items() if isinstance(other, DropCounter) else other.items()
        for reason, n in items:
            self.add(reason, n)

    def __repr__(self) -> str:
        return f"DropCounter({self.name!r}, {self.snapshot()})"


class LatencyHistogram:
    """Log-linear histogram of non-negative integer values (ns), HdrHistogram style.

    Values below `2**sub_bucket_bits` are exact; above, each power-of-two range is split into
    `2**(sub_bucket_bits-1)` equal sub-buckets. Values above `highest_ns` are clamped and
    counted in `clamped`; negative values are counted in `rejected` and not recorded.
    Exact min, max and sum are kept alongside the buckets.
    """

    __slots__ = ("_counts", "_half", "_sub", "bits", "clamped", "count", "highest_ns", "max", "min", "rejected", "sum")

    def __init__(self, sub_bucket_bits: int = 8, highest_ns: int = 1 << 44) -> None:
        if not 2 <= sub_bucket_bits <= 16:
            raise ValueError(f"sub_bucket_bits={sub_bucket_bits}; expected 2..16")
        if highest_ns < (1 << sub_bucket_bits):
            raise ValueError(f"highest_ns={highest_ns} must be >= 2**sub_bucket_bits")
        self.bits = sub_bucket_bits
        self._sub = 1 << sub_bucket_bits
        self._half = self._sub >> 1
        self.highest_ns = int(highest_ns)
        self._counts = np.zeros(self._index(self.highest_ns) + 1, dtype=np.int64)
        self.count = 0
        self.sum = 0
        self.min = 0
        self.max = 0
        self.clamped = 0
        self.rejected = 0

    def _index(self, v: int) -> int:
        if v < self._sub:
            return v
        shift = v.bit_length() - self.bits
        return self._sub + (shift - 1) * self._half + ((v >> shift) - self._half)

    def _bucket_bounds(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lowest and highest value mapped to each index."""
        idx = np.asarray(idx, dtype=np.int64)
        lin = idx < self._sub
        rel = np.maximum(idx - self._sub, 0)
        shift = rel // self._half + 1
        low = np.where(lin, idx, ((rel % self._half) + self._half) << shift)
        high = np.where(lin, idx, low + (np.int64(1) << shift) - 1)
        return low, high

    def record(self, value_ns: int | float) -> None:
        """Record one value in ns (floats are rounded)."""
        v = int(value_ns) if isinstance(value_ns, int) else (round(value_ns) if math.isfinite(value_ns) else -1)
        if v < 0:
            self.rejected += 1
            return
        if v > self.highest_ns:
            self.clamped += 1
            v = self.highest_ns
        self._counts[self._index(v)] += 1
        if self.count == 0 or v < self.min:
            self.min = v
        if v > self.max:
            self.max = v
        self.count += 1
        self.sum += v

    def record_many(self, values_ns: Iterable[int | float] | np.ndarray) -> None:
        """Record many values at once (vectorised)."""
        arr = np.asarray(values_ns)
        if arr.size == 0:
            return
        arr = arr.astype(np.float64, copy=False).ravel()
        bad = ~np.isfinite(arr) | (arr < 0)
        nbad = int(bad.sum())
        if nbad:
            self.rejected += nbad
            arr = arr[~bad]
            if arr.size == 0:
                return
        v = np.rint(arr).astype(np.int64)
        over = v > self.highest_ns
        self.clamped += int(over.sum())
        np.minimum(v, self.highest_ns, out=v)
        shift = np.maximum(np.frexp(v.astype(np.float64))[1] - self.bits, 0).astype(np.int64)
        idx = np.where(shift == 0, v, self._sub + (shift - 1) * self._half + ((v >> shift) - self._half))
        np.add.at(self._counts, idx, 1)
        vmin, vmax = int(v.min()), int(v.max())
        self.min = vmin if self.count == 0 else min(self.min, vmin)
        self.max = max(self.max, vmax)
        self.count += int(v.size)
        self.sum += int(v.sum())

    def percentile(self, p: float) -> int:
        """Value at percentile `p` in [0, 100] (highest value of its bucket, capped at the exact max)."""
        if not 0.0 <= p <= 100.0:
            raise ValueError(f"percentile {p} outside [0, 100]")
        if self.count == 0:
            return 0
        if p == 100.0:
            return self.max
        rank = max(1, math.ceil(p / 100.0 * self.count))
        idx = int(np.searchsorted(np.cumsum(self._counts), rank))
        _, high = self._bucket_bounds(np.array([idx]))
        return int(min(max(int(high[0]), self.min), self.max))

    def percentiles(self, ps: Iterable[float] = (50.0, 95.0, 99.0)) -> dict[str, int]:
        """Several percentiles at once, keyed `p50`, `p95`, ... plus `max`."""
        out = {f"p{p:g}": self.percentile(p) for p in ps}
        out["max"] = self.max
        return out

    @property
    def mean(self) -> float:
        """Exact mean of the recorded (possibly clamped) values."""
        return self.sum / self.count if self.count else 0.0

    def merge(self, other: LatencyHistogram) -> None:
        """Add another histogram with the same configuration into this one."""
        if other.bits != self.bits or other.highest_ns != self.highest_ns:
            raise ValueError(
                f"cannot merge histograms with different configs "
                f"(bits {self.bits} vs {other.bits}, highest {self.highest_ns} vs {other.highest_ns})"
            )
        if other.count:
            self.min = other.min if self.count == 0 else min(self.min, other.min)
            self.max = max(self.max, other.max)
        self._counts += other._counts
        self.count += other.count
        self.sum += other.sum
        self.clamped += other.clamped
        self.rejected += other.rejected

    def reset(self) -> None:
        """Forget every recorded value."""
        self._counts[:] = 0
        self.count = self.sum = self.min = self.max = self.clamped = self.rejected = 0

    def summary_ms(self) -> dict[str, float]:
        """P50/P95/P99/max and mean in milliseconds, for reports."""
        d: dict[str, float] = {k: v / 1e6 for k, v in self.percentiles().items()}
        d["mean"] = self.mean / 1e6
        d["count"] = float(self.count)
        return d

    def __repr__(self) -> str:
        return f"LatencyHistogram(count={self.count}, {self.percentiles()})"
