from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.core import AudioChunk, InvalidPacket
from tristream.core.clock import SourceClock
from tristream.core.synth import SourceSpec, generate_stream


def _run(clock: SourceClock, s, order=None) -> np.ndarray:  # type: ignore[no-untyped-def]
    refs = np.zeros(len(s), dtype=np.int64)
    idx = np.argsort(s.arrival_ns, kind="stable") if order is None else order
    for i in idx:
        refs[i] = clock.observe_span(int(s.src_ns[i]), int(s.src_ns[i] + s.dur_ns[i]), int(s.arrival_ns[i]))
    return refs


ISSUE_SPEC = SourceSpec(
    "mic0", "audio", "samples@16000", 320, 320,
    drift_ppm=100.0, latency_ns=0, jitter_scale_ns=2e6, jitter_cap_ns=20e6,
    spike_prob=0.005, stall_prob=0.002, reorder_prob=0.01, reset_at_s=30.0,
)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_convergence_issue_scenario(seed: int) -> None:
    """60 s, 100 ppm drift, heavy-tailed jitter in a 20 ms band (±10 ms), 1 % reorder, one reset."""
    s = generate_stream(ISSUE_SPEC, 60.0, seed)
    assert s.meta["reordered_swaps"] > 10
    clock = SourceClock("mic0")
    refs = _run(clock, s)
    assert abs(clock.drift_ppm - 100.0) < 1.0  # issue asks for 2 ppm; keep a 2x margin
    assert clock.counts["reset"] == 1 and clock.epoch == 1
    assert clock.counts["outlier"] == 0
    assert clock.counts["reordered"] > 0
    late = s.true_ref_ns > s.true_ref_ns[0] + 10e9
    err = np.abs(refs - s.true_ref_ns)[late]
    assert np.percentile(err, 99) < 1e6
    assert 0 < clock.uncertainty_ns < 1e6


def test_negative_drift_and_latency() -> None:
    spec = SourceSpec("cam0", "video", "ns", 33_333_333, 0, drift_ppm=-250.0, latency_ns=40_000_000,
                      origin_ticks=10**12, jitter_scale_ns=3e6, reorder_prob=0.0)
    s = generate_stream(spec, 30.0, 7)
    clock = SourceClock("cam0", latency_ns=40_000_000)
    refs = _run(clock, s)
    assert abs(clock.drift_ppm + 250.0) < 2.0
    err = (refs - s.true_ref_ns)[s.true_ref_ns > s.true_ref_ns[0] + 10e9]
    assert np.percentile(np.abs(err), 99) < 1e6
    assert abs(clock.offset_ns - (s.true_ref_ns[-1] - s.src_ns[-1])) < 1e6


@settings(max_examples=25, deadline=None)
@given(
    drift=st.floats(min_value=-500.0, max_value=500.0),
    origin=st.integers(min_value=0, max_value=10**15),
    latency=st.integers(min_value=0, max_value=100_000_000),
)
def test_noise_free_fit_is_exact(drift: float, origin: int, latency: int) -> None:
    spec = SourceSpec("s", "video", "ns", 20_000_000, 0, drift_ppm=drift, latency_ns=latency,
                      origin_ticks=origin, jitter_scale_ns=0.0, spike_prob=0.0, reorder_prob=0.0)
    s = generate_stream(spec, 8.0, 0)
    clock = SourceClock("s", latency_ns=latency)
    refs = _run(clock, s)
    assert abs(clock.drift_ppm - drift) < 0.05
    tail = slice(len(s) // 2, None)
    assert np.max(np.abs(refs - s.true_ref_ns)[tail]) < 20_000  # 20 µs


@settings(max_examples=15, deadline=None)
@given(shift=st.integers(min_value=-10**9, max_value=10**9), seed=st.integers(0, 50))
def test_arrival_shift_shifts_ref(shift: int, seed: int) -> None:
    spec = SourceSpec("s", "audio", "samples@16000", 320, 320, drift_ppm=30.0, reorder_prob=0.02)
    s = generate_stream(spec, 6.0, seed)
    a = _run(SourceClock("s"), s)
    s.arrival_ns = s.arrival_ns + shift + 10**10
    b = _run(SourceClock("s"), s)
    assert np.max(np.abs((b - a) - (shift + 10**10))) <= 2


@settings(max_examples=10, deadline=None)
@given(jump_s=st.sampled_from([-20.0, -1.0, 5.0, 3600.0]), seed=st.integers(0, 100))
def test_reset_detected_and_drift_kept(jump_s: float, seed: int) -> None:
    spec = SourceSpec("s", "video", "us", 20_000, 0, drift_ppm=60.0, jitter_scale_ns=1e6, reorder_prob=0.0,
                      origin_ticks=50_000_000, reset_at_s=12.0,
                      reset_to_ticks=int(50_000_000 + 12e6 * (1 + 60e-6) + jump_s * 1e6))
    s = generate_stream(spec, 20.0, seed)
    clock = SourceClock("s", latency_ns=spec.latency_ns)
    refs = _run(clock, s)
    assert clock.counts["reset"] == 1
    # 8 s of 1 ms-jitter packets after the reset: over every (jump, seed) of this test's space the
    # estimate stays within 6.2 ppm (48 µs over those 8 s); 5 ppm failed 4 of the 404 cases
    assert abs(clock.drift_ppm - 60.0) < 8.0
    after = s.epoch == 1
    err = np.abs(refs - s.true_ref_ns)[after][10:]
    assert np.percentile(err, 95) < 1e6


def test_single_bad_timestamp_is_an_outlier() -> None:
    spec = SourceSpec("s", "video", "ns", 20_000_000, 0, drift_ppm=0.0, jitter_scale_ns=1e6, reorder_prob=0.0)
    s = generate_stream(spec, 10.0, 3)
    s.src_ns[250] += 7 * 10**9  # one corrupt PTS, 7 s in the future
    clock = SourceClock("s", latency_ns=spec.latency_ns)
    refs = _run(clock, s)
    assert clock.counts["outlier"] == 1 and clock.counts["reset"] == 0
    ok = np.ones(len(s), bool)
    ok[250] = False
    assert np.percentile(np.abs(refs - s.true_ref_ns)[ok][100:], 99) < 1e6


def test_map_packet_sets_ref_of_first_sample() -> None:
    clock = SourceClock("mic")
    for k in range(200):
        pkt = AudioChunk(session_id="s", source_id="mic", ts=k * 320, unit="samples@16000",  # type: ignore[arg-type]
                         arrival_ns=10**9 + (k + 1) * 20_000_000 + 5_000_000, pcm=np.zeros(320, np.int16),
                         sample_rate=16000)
        ref = clock.map_packet(pkt)
        assert pkt.ref_ns == ref
    assert abs(ref - (10**9 + 199 * 20_000_000 + 5_000_000)) < 1000
    assert clock.to_ref(200 * 20_000_000) == pytest.approx(10**9 + 200 * 20_000_000 + 5_000_000, abs=1000)
    st_ = clock.state()
    assert st_.packets == 200 and st_.epoch == 0


def test_errors() -> None:
    clock = SourceClock("x")
    with pytest.raises(InvalidPacket, match="no packet"):
        clock.to_ref(0)
    with pytest.raises(InvalidPacket, match="before it starts"):
        clock.observe_span(10, 5, 100)
    with pytest.raises(InvalidPacket, match="integer ns"):
        clock.observe(float("nan"), 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SourceClock("x", window_ns=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_robust_to_packets_stamped_too_early(seed: int) -> None:
    """0.5 % of packets seem to arrive 1-9 ms earlier than physically possible (stamped late)."""
    s = generate_stream(ISSUE_SPEC, 60.0, seed)
    rng = np.random.default_rng(seed + 100)
    bad = rng.random(len(s)) < 0.005
    s.arrival_ns[bad] -= rng.integers(1_000_000, 9_000_000, int(bad.sum()))
    clock = SourceClock("mic0")
    refs = _run(clock, s)
    assert abs(clock.drift_ppm - 100.0) < 1.0
    late = (s.true_ref_ns > s.true_ref_ns[0] + 10e9) & ~bad
    assert np.percentile(np.abs(refs - s.true_ref_ns)[late], 99) < 1e6


def test_long_delayed_packet_is_mapped_by_its_timestamp() -> None:
    spec = SourceSpec("s", "video", "ns", 20_000_000, 0, drift_ppm=0.0, jitter_scale_ns=1e6, reorder_prob=0.0,
                      spike_prob=0.0)
    s = generate_stream(spec, 10.0, 5)
    s.arrival_ns[300] += 700_000_000  # one packet held up for 0.7 s (behind 35 newer ones)
    clock = SourceClock("s", latency_ns=spec.latency_ns)
    refs = _run(clock, s)
    # it lands in the hole it left in the timeline: held up, never a reset candidate (nor an outlier)
    assert clock.counts["delayed"] == 1 and clock.counts["outlier"] == 0 and clock.counts["reset"] == 0
    assert clock.counts["gap"] == 0
    assert abs(refs[300] - s.true_ref_ns[300]) < 1e6


def _chunks(clock: SourceClock, chunks: list[tuple[int, int]], span: int) -> None:
    for start, arrival in chunks:
        clock.observe_span(start, start + span, arrival)


@pytest.mark.parametrize("back_chunks", [1, 2, 3, 12])
def test_a_restart_a_little_behind_is_a_reset_not_reordering(back_chunks: int) -> None:
    """A source that restarts less than `reset_back_ns` behind where it was (its new chunks cover
    samples already received) opens an epoch; reordered and very late chunks do not."""
    span = 10_000_000  # 10 ms chunks, each arriving 3 ms after its end
    t0 = 10**9
    before = [(k * span, t0 + k * span + span + 3_000_000) for k in range(600)]
    restart = before[-1][0] - back_chunks * span + 3_333_333  # 7-117 ms behind, on the reference clock 10 ms on
    after = [(restart + k * span, before[-1][1] + (k + 1) * span) for k in range(300)]
    clock = SourceClock("mic")
    _chunks(clock, before + after, span)
    assert clock.counts["reset"] == 1 and clock.epoch == 1
    assert clock.counts["reordered"] == 0 and clock.counts["outlier"] == 0

    clock = SourceClock("mic")
    chunks = before[:]
    chunks[300], chunks[301] = chunks[301], chunks[300]  # one chunk held behind its successor
    late = (chunks[410][0], chunks[410][1] + 1_500_000_000)  # one of 20 lost chunks arrives 1.5 s late, after
    chunks = chunks[:400] + chunks[420:]  # its gap is counted
    chunks.insert(next(k for k, c in enumerate(chunks) if c[1] > late[1]), late)
    _chunks(clock, chunks, span)
    clock.close()
    assert clock.counts["reset"] == 0 and clock.epoch == 0
    assert clock.counts["gap"] == 1 and clock.counts["reordered"] == 1  # (the late one: `delayed`)
