from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.core import DropCounter, LatencyHistogram


def test_drop_counter() -> None:
    d = DropCounter("ring")
    d.add("late")
    d.add("late", 2)
    d.add("evicted")
    assert d["late"] == 3 and d["evicted"] == 1 and d["missing"] == 0 and d.total == 4
    e = DropCounter()
    e.merge(d)
    e.merge({"late": 1})
    assert e.snapshot() == {"evicted": 1, "late": 4}
    with pytest.raises(ValueError):
        d.add("late", -1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**12), min_size=1, max_size=300),
       st.sampled_from([50.0, 95.0, 99.0, 100.0]))
def test_histogram_percentile_within_relative_error(values: list[int], p: float) -> None:
    h = LatencyHistogram(sub_bucket_bits=8)
    for v in values:
        h.record(v)
    g = LatencyHistogram(sub_bucket_bits=8)
    g.record_many(np.array(values))
    assert h.percentile(p) == g.percentile(p)
    exact = int(np.percentile(np.array(values), p, method="inverted_cdf"))
    got = h.percentile(p)
    assert got >= exact
    assert got - exact <= max(exact, 1) * 2.0 ** -7
    assert h.max == max(values) and h.min == min(values) and h.count == len(values)


def test_histogram_merge_and_counters() -> None:
    rng = np.random.default_rng(1)
    a_vals = rng.integers(0, 10**9, 5000)
    b_vals = rng.integers(0, 10**7, 5000)
    a, b, both = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    a.record_many(a_vals)
    b.record_many(b_vals)
    both.record_many(np.concatenate([a_vals, b_vals]))
    a.merge(b)
    assert a.percentiles() == both.percentiles() and a.count == 10000
    a.record(-5)
    a.record_many([np.nan, -1.0])
    assert a.rejected == 3
    small = LatencyHistogram(highest_ns=1 << 20)
    small.record(1 << 30)
    assert small.clamped == 1 and small.max == 1 << 20
    with pytest.raises(ValueError):
        a.merge(small)
    assert LatencyHistogram().percentile(99) == 0
