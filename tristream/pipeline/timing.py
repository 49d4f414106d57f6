"""Per-stage timing histograms for the pipeline.

A small log-linear histogram (32 sub-buckets per power of two: ~3% precision, O(1) record,
fixed memory) so that per-packet timing costs well under a microsecond.
"""

from __future__ import annotations

from typing import Protocol


class Recorder(Protocol):
    """Anything that records non-negative integer samples (nanoseconds)."""

    def record(self, value: int) -> None: ...


_SUB_BITS = 5
_SUB = 1 << _SUB_BITS
_MAX_BUCKETS = (64 - _SUB_BITS) * _SUB + 2 * _SUB


class LatencyHistogram:
    """Log-linear histogram of integer samples (ns): O(1) record, P50/P95/P99/max."""

    __slots__ = ("counts", "count", "max", "min", "total")

    def __init__(self) -> None:
        self.counts = [0] * _MAX_BUCKETS
        self.count = 0
        self.max = 0
        self.min = -1
        self.total = 0

    def record(self, value: int) -> None:
        """Add one sample (negative values are clamped to 0)."""
        if value < 0:
            value = 0
        if value < 2 * _SUB:
            idx = value
        else:
            e = value.bit_length() - (_SUB_BITS + 1)
            idx = e * _SUB + (value >> e)
        self.counts[idx] += 1
        self.count += 1
        self.total += value
        if value > self.max:
            self.max = value
        if self.min < 0 or value < self.min:
            self.min = value

    @staticmethod
    def _bucket_value(idx: int) -> int:
        if idx < 2 * _SUB:
            return idx
        e = idx // _SUB - 1
        m = idx - e * _SUB
        # midpoint of the bucket [m << e, (m + 1) << e)
        return (m << e) + ((1 << e) >> 1)

    def percentile(self, q: float) -> int:
        """Value at quantile `q` in [0, 100] (bucket midpoint, clamped to min/max)."""
        if self.count == 0:
            return 0
        target = max(1, int(round(self.count * q / 100.0)))
        acc = 0
        for idx, c in enumerate(self.counts):
            if c:
                acc += c
                if acc >= target:
                    v = self._bucket_value(idx)
                    return max(self.min, min(self.max, v))
        return self.max

    @property
    def mean(self) -> float:
        """Arithmetic mean of the samples."""
        return self.total / self.count if self.count else 0.0

    def summary(self, scale: float = 1e-3) -> dict[str, float]:
        """P50/P95/P99/max/mean/count, values multiplied by `scale` (default ns→µs)."""
        return {
            "count": float(self.count),
            "p50": self.percentile(50) * scale,
            "p95": self.percentile(95) * scale,
            "p99": self.percentile(99) * scale,
            "max": self.max * scale,
            "mean": self.mean * scale,
        }


def new_histogram() -> LatencyHistogram:
    """A fresh histogram for one stage's per-packet handling time (ns)."""
    return LatencyHistogram()
