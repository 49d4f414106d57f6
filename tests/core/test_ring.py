from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.core import InvalidPacket
from tristream.core.ring import ObjectRing, TimeIndexedRing

P = 62_500  # ns per sample at 16 kHz
T0 = 10**12


def _stream(sizes: list[int]) -> list[tuple[int, np.ndarray, int]]:
    """Contiguous chunks: (t_ns of first sample, values = absolute sample index, start index)."""
    out = []
    i = 0
    for n in sizes:
        out.append((T0 + i * P, np.arange(i, i + n, dtype=np.float64), i))
        i += n
    return out


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=60),
    cap=st.integers(8, 200),
    queries=st.lists(st.tuples(st.integers(-30, 3100), st.integers(0, 300)), min_size=1, max_size=10),
)
def test_window_equals_brute_force(sizes: list[int], cap: int, queries: list[tuple[int, int]]) -> None:
    ring = TimeIndexedRing(16000, cap, dtype=np.float64)
    chunks = _stream(sizes)
    for t, v, _ in chunks:
        ring.append(t, v)
    total = sum(sizes)
    held = np.arange(max(0, total - cap), total)
    for a, length in queries:
        t0 = T0 + a * P - P // 3
        t1 = t0 + length * P
        w = ring.window(t0, t1)
        times = T0 + held * P
        expect = held[(times >= t0) & (times < t1)]
        np.testing.assert_array_equal(w.data, expect.astype(np.float64))
        assert w.missing == 0
        if expect.size:
            assert w.start_ns == T0 + int(expect[0]) * P
            assert np.shares_memory(w.data, ring._buf)  # a view, never a copy
    assert ring.size == min(total, cap)
    assert ring.counts["evicted"] == max(0, total - cap)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=2, max_size=40),
    swaps=st.lists(st.integers(0, 38), max_size=10),
)
def test_out_of_order_within_lateness_lands_in_place(sizes: list[int], swaps: list[int]) -> None:
    chunks = _stream(sizes)
    order = list(range(len(chunks)))
    for s in swaps:
        if s + 1 < len(order):
            order[s], order[s + 1] = order[s + 1], order[s]
    ring = TimeIndexedRing(16000, 4096, dtype=np.float64, lateness_ns=10**9, snap_ns=0)
    for k in order:
        t, v, _ = chunks[k]
        ring.append(t, v)
    total = sum(sizes)
    w = ring.window(T0, T0 + total * P)
    # A leading chunk arriving after the first never lands before index 0 of the ring.
    first = order[0]
    start = chunks[first][2]
    np.testing.assert_array_equal(w.data, np.arange(start, total, dtype=np.float64))
    assert w.missing == 0
    counts = ring.counts
    assert counts["gap_samples"] == 0 and counts["overlap"] == 0
    assert counts["late"] == sum(sizes[k] for k in range(first))


def test_gap_late_drop_and_counters() -> None:
    ring = TimeIndexedRing(16000, 1600, lateness_ns=50_000_000, snap_ns=0)
    ring.append(T0, np.ones(320, np.float32))
    ring.append(T0 + 640 * P, np.ones(320, np.float32))  # one chunk missing
    w = ring.window(T0, T0 + 960 * P)
    assert len(w) == 960 and w.missing == 320
    assert np.all(w.data[320:640] == 0)
    for k in range(3, 20):  # move well past the lateness bound
        ring.append(T0 + k * 320 * P, np.ones(320, np.float32))
    assert ring.counts["gap_samples"] == 320
    assert ring.append(T0 + 320 * P, np.ones(320, np.float32)) == -1
    assert ring.counts["late"] == 320


def test_latest_at_or_before_fill_ratio_and_overrun() -> None:
    ring = TimeIndexedRing(100, 50)
    assert ring.latest_at_or_before(T0) is None
    for k in range(8):
        ring.append(T0 + k * 10 * 10_000_000, np.arange(k * 10, k * 10 + 10, dtype=np.float32))
    assert ring.fill_ratio == 1.0 and ring.high_water == 1.0
    t, v = ring.latest_at_or_before(T0 + 555_000_000)  # type: ignore[misc]
    assert t == T0 + 550_000_000 and float(v) == 55.0
    assert ring.latest_at_or_before(T0 + 100_000_000) is None  # evicted
    ring.consume_until(T0 + 700_000_000)
    assert ring.fill_ratio == pytest.approx(10 / 50)
    ring.append(T0 + 800_000_000, np.zeros(45, np.float32))
    assert ring.counts["overrun"] == 5


def test_drifting_timestamps_stay_contiguous() -> None:
    ring = TimeIndexedRing(16000, 16000 * 5)
    rate = 1.0 + 80e-6
    for k in range(500):
        ring.append(T0 + round(k * 20_000_000 / rate), np.full(320, k, np.float32))
    c = ring.counts
    assert c["gap_samples"] == 0 and c["overlap"] == 0
    w = ring.window(T0 + round(400 * 20_000_000 / rate), T0 + round(401 * 20_000_000 / rate))
    assert len(w) == 320 and np.all(w.data == 400)


def test_multichannel_and_errors() -> None:
    ring = TimeIndexedRing(200, 100, channels=6)
    ring.append(T0, np.ones((10, 6)))
    assert ring.window(T0, T0 + 10**9).data.shape == (10, 6)
    with pytest.raises(InvalidPacket, match=r"\(n, 6\)"):
        ring.append(T0 + 50_000_000, np.ones((10, 3)))
    with pytest.raises(InvalidPacket, match="0 samples"):
        ring.append(T0, np.ones((0, 6)))
    with pytest.raises(InvalidPacket, match="ends before"):
        ring.window(5, 1)
    with pytest.raises(ValueError):
        TimeIndexedRing(0, 10)


def test_object_ring() -> None:
    r: ObjectRing[str] = ObjectRing(4, lateness_ns=100)
    assert r.latest_at_or_before(5) is None
    for t in (10, 20, 40):
        assert r.append(t, f"f{t}")
    assert r.append(30, "f30")  # out of order within lateness: lands in place
    assert [t for t, _ in r.items()] == [10, 20, 30, 40]
    assert r.append(50, "f50")  # evicts f10
    assert r.counts["evicted"] == 1 and r.counts["reordered"] == 1
    assert not r.append(-100, "old")
    assert r.counts["late"] == 1
    assert r.latest_at_or_before(35) == (30, "f30")
    assert r.nearest(44) == (40, "f40")
    assert r.window(20, 41) == [(20, "f20"), (30, "f30"), (40, "f40")]
    assert r.fill_ratio == 1.0
    r.consume_until(35)
    assert r.fill_ratio == 0.5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=80), st.integers(1, 30), st.integers(0, 1000))
def test_object_ring_matches_brute_force(times: list[int], cap: int, q: int) -> None:
    r: ObjectRing[int] = ObjectRing(cap, lateness_ns=10**6)
    for i, t in enumerate(times):
        r.append(t, i)
    held = sorted(times)[-cap:] if len(times) >= cap else sorted(times)
    got = [t for t, _ in r.items()]
    # Items arriving older than the oldest held item of a full ring are late; the rest match.
    assert got == sorted(got)
    assert len(got) == min(cap, len(times) - r.counts["late"])
    before = [t for t in got if t <= q]
    hit = r.latest_at_or_before(q)
    assert (hit[0] if hit else None) == (before[-1] if before else None)
    assert set(got) <= set(held) | set(times)


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(1, 30), st.sampled_from(["float32", "float64", "int16", ">f4"]),
                              st.sampled_from(["contiguous", "strided", "fortran"])), min_size=1, max_size=40),
    cap=st.integers(8, 120),
    channels=st.sampled_from([1, 3]),
)
def test_chunks_of_any_dtype_and_layout_land_in_both_halves(chunks: list[tuple[int, str, str]], cap: int,
                                                             channels: int) -> None:
    # The hot path copies a chunk of the ring's dtype through a flat memoryview; any other dtype,
    # byte order or memory layout goes the numpy way. Both must store the same values in both halves.
    ring = TimeIndexedRing(16000, cap, channels=channels, dtype=np.float32)
    i = 0
    for n, dtype, layout in chunks:
        vals = np.arange(i * channels, (i + n) * channels, dtype=np.float64).reshape(n, channels) % 30000
        if layout == "strided":
            wide = np.zeros((2 * n, channels), dtype)
            wide[::2] = vals
            chunk = wide[::2]
        elif layout == "fortran":
            chunk = np.asfortranarray(vals.astype(dtype))
        else:
            chunk = vals.astype(dtype)
        if channels == 1:
            chunk = chunk[:, 0]
        assert ring.append(T0 + i * P, chunk) == i
        i += n
        np.testing.assert_array_equal(ring._buf[:cap], ring._buf[cap:])
    held = np.arange(max(0, i - cap), i)
    w = ring.window(T0 + int(held[0]) * P, T0 + i * P)
    expect = (np.arange(held[0] * channels, i * channels, dtype=np.float64).reshape(-1, channels) % 30000)
    np.testing.assert_array_equal(w.data, expect[:, 0] if channels == 1 else expect)
