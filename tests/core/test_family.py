"""The scenario family: wandering drift, wraps, loss, duplicates, congestion, resets (issue 25)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tristream.core.clock import SourceClock
from tristream.core.curve import _too_early
from tristream.core.family import FAULTS, RateModel, generate_family
from tristream.core.offline import fit_source
from tristream.core.scenario import cross_modal_error, run_online
from tristream.core.units import parse_unit

FAULT_SETS = st.sets(st.sampled_from(FAULTS), min_size=1)


def _offline(streams: dict) -> dict:  # type: ignore[type-arg]
    return {sid: fit_source(sid, s.src_ns, s.src_ns + s.dur_ns, s.arrival_ns, latency_ns=s.spec.latency_ns,
                            wrap_ns=parse_unit(s.spec.unit).wrap_ns) for sid, s in streams.items()}


def _replay(clock: SourceClock, s, order=None) -> np.ndarray:  # type: ignore[no-untyped-def]
    refs = np.zeros(len(s), np.int64)
    for i in (np.argsort(s.arrival_ns, kind="stable") if order is None else order):
        refs[i] = clock.observe_span(int(s.src_ns[i]), int(s.src_ns[i] + s.dur_ns[i]), int(s.arrival_ns[i]))
    return refs


def test_generator_is_seeded_and_varies() -> None:
    a = generate_family("all", 3, 40.0)
    b = generate_family("all", 3, 40.0)
    c = generate_family("all", 4, 40.0)
    assert all(np.array_equal(a[k].arrival_ns, b[k].arrival_ns) for k in a)
    assert any(a[k].spec.latency_ns != c[k].spec.latency_ns for k in a)
    ra, rc = a["cam0"].meta["rate_model"], c["cam0"].meta["rate_model"]
    assert isinstance(ra, RateModel) and ra != rc
    with pytest.raises(ValueError, match="unknown faults"):
        generate_family({"drift", "solar flare"}, 1, 10.0)


def test_rate_model_elapsed_integrates_rate() -> None:
    m = RateModel(80e-6, 30e-6, 90.0, 1.0, (20.0,), (-10e-6,))
    t = np.linspace(0.0, 60.0, 600_001)
    num = np.concatenate([[0.0], np.cumsum(0.5 * (m.rate(t[1:]) + m.rate(t[:-1])) * np.diff(t))])
    assert np.max(np.abs(m.elapsed(t) - t - num)) < 1e-9


@settings(max_examples=12, deadline=None, derandomize=True)  # the same draws every run; known misses below
@given(faults=FAULT_SETS, seed=st.integers(0, 10_000))
@example(faults={"drift", "wrap", "network", "loss"}, seed=483)  # a sparse IMU through a 70 s temperature swing
@example(faults=set(FAULTS), seed=8)  # the IMU back from a silence for the 5 s before it is replugged
@example(faults=set(FAULTS), seed=1)
@example(faults={"drift", "loss", "network", "reset"}, seed=9916)  # sparse, noisy IMU bins taken for stamped late
def test_offline_counts_every_fault_and_meets_the_target(faults: set[str], seed: int) -> None:
    """Over random fault sets and seeds: every wrap, duplicate, gap and reset counted exactly;
    cross-modal P99 <= 0.3 ms and <= 5 events more than 5 ms off."""
    streams = generate_family(faults, seed, 300.0)
    fits = _offline(streams)
    for sid, s in streams.items():
        sm, truth = fits[sid].summary, s.meta["truth"]
        assert (sm["wraps"], sm["duplicates"], sm["gaps"], sm["lost_packets"], sm["resets"]) == (
            truth["wraps"], truth["duplicates"], truth["gaps"], truth["lost"], truth["resets"]), sid
        assert sm["epochs"] == truth["resets"] + 1
    refs = {sid: f.ref_ns for sid, f in fits.items()}
    err = cross_modal_error(streams, refs, warmup_s=0.0)
    assert err["all"]["p99"] <= 0.3
    off = sum(int(np.sum(np.abs(refs[k] - s.true_ref_ns) > 5e6)) for k, s in streams.items())
    assert off <= 5


@pytest.mark.xfail(strict=True, reason="known misses of the offline target (issue 25): a sparse IMU (5 packets/s) "
                   "under heavy jitter; at 9295 its first 17 s hold one bin outside congestion, 0.44 ms above the floor")
@pytest.mark.parametrize(("faults", "seed"), [({"drift", "network"}, 9295), ({"network", "reset"}, 1320)])
def test_offline_target_known_misses(faults: set[str], seed: int) -> None:
    """The property test's offline target at draws it is known to miss (strict: a fix shows here)."""
    test_offline_counts_every_fault_and_meets_the_target.hypothesis.inner_test(faults=faults, seed=seed)  # type: ignore[attr-defined]


@settings(max_examples=8, deadline=None, derandomize=True)  # the same draws every run; known misses below
@given(faults=FAULT_SETS, seed=st.integers(0, 10_000))
@example(faults={"wrap", "reset", "loss"}, seed=118)  # a restart at raw 0 right after a wrap
@example(faults={"drift", "loss", "network", "reset", "wrap"}, seed=3407)  # a hole open at the end
@example(faults={"loss", "drift", "wrap", "network", "reset"}, seed=2574)  # a held-up packet fills its hole
@example(faults={"loss", "network", "wrap"}, seed=664)  # the second frame of the stream lost
@example(faults={"loss", "wrap", "drift", "network"}, seed=531)  # the last packet before a silence comes after it
@example(faults={"reset", "drift", "network", "wrap"}, seed=96)  # a restart at raw 0 five chunks after a wrap (-22 ms)
def test_online_counts_every_fault(faults: set[str], seed: int) -> None:
    streams = generate_family(faults, seed, 60.0)
    res = run_online(streams, sync=False)  # closes the clocks at the end: open holes are gaps
    for sid, s in streams.items():
        c, truth = res.counters[f"clock:{sid}"], s.meta["truth"]
        assert (c.get("wrap", 0), c.get("duplicate", 0), c.get("reset", 0), c.get("gap", 0), c.get("lost", 0)) == (
            truth["wraps"], truth["duplicates"], truth["resets"], truth["gaps"], truth["lost"]), sid
        assert res.clocks[sid].open_gaps == 0, sid


@settings(max_examples=10, deadline=None)
@given(unit=st.sampled_from(["rtp@90000", "rtp@48000", "pts90k"]), seed=st.integers(0, 10_000),
       before_s=st.floats(1.0, 20.0), drift=st.floats(-150.0, 150.0))
def test_a_wrap_never_creates_an_epoch(unit: str, seed: int, before_s: float, drift: float) -> None:
    u = parse_unit(unit)
    rng = np.random.default_rng(seed)
    period = u.ticks_per_s // 50
    n = 1500
    wrap = 1 << u.wrap_bits
    ticks = (wrap - int(before_s * u.ticks_per_s) + np.arange(n) * period) % wrap
    true = 1e9 + np.arange(n) * period * 1e9 / u.ticks_per_s / (1 + drift * 1e-6)
    arrival = (true + 5e6 + rng.exponential(2e6, n)).astype(np.int64)
    src = u.to_ns_array(ticks)
    clock = SourceClock("s", wrap_ns=u.wrap_ns)
    refs = np.array([clock.observe(int(a), int(b)) for a, b in zip(src, arrival, strict=True)])
    assert clock.counts["wrap"] == 1 and clock.counts["reset"] == 0 and clock.epoch == 0
    assert np.percentile(np.abs(refs - (true + 5e6))[500:], 99) < 1e6
    fit = fit_source("s", src, src, arrival, latency_ns=0, wrap_ns=u.wrap_ns)
    assert fit.summary["epochs"] == 1 and fit.summary["wraps"] == 1 and fit.summary["resets"] == 0
    assert np.max(np.abs(fit.ref_ns - (true + 5e6))) < 0.5e6


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(100, 900), delay_ms=st.floats(0.1, 1500.0))
def test_a_duplicate_is_reported_once_and_does_not_move_the_fit(seed: int, k: int, delay_ms: float) -> None:
    streams = generate_family({"drift", "network"}, seed, 30.0)
    s = streams["mic0"]
    order = list(np.argsort(s.arrival_ns, kind="stable"))
    a = SourceClock("mic0", latency_ns=s.spec.latency_ns)
    base = _replay(a, s, order)
    # the same capture again, delay_ms after the original
    copy_arrival = int(s.arrival_ns[k] + delay_ms * 1e6)
    b = SourceClock("mic0", latency_ns=s.spec.latency_ns)
    refs = np.zeros(len(s), np.int64)
    dup_ref = None
    for i in order:
        if dup_ref is None and s.arrival_ns[i] > copy_arrival:
            dup_ref = b.observe_span(int(s.src_ns[k]), int(s.src_ns[k] + s.dur_ns[k]), copy_arrival)
        refs[i] = b.observe_span(int(s.src_ns[i]), int(s.src_ns[i] + s.dur_ns[i]), int(s.arrival_ns[i]))
    assert b.counts["duplicate"] == 1
    assert dup_ref == refs[k]
    assert np.array_equal(refs, base) and b.drift_ppm == a.drift_ppm
    src = np.r_[s.src_ns, s.src_ns[k]]
    fit = fit_source("mic0", src, src + np.r_[s.dur_ns, s.dur_ns[k]], np.r_[s.arrival_ns, copy_arrival],
                     latency_ns=s.spec.latency_ns)
    ref0 = fit_source("mic0", s.src_ns, s.src_ns + s.dur_ns, s.arrival_ns, latency_ns=s.spec.latency_ns).ref_ns
    assert fit.summary["duplicates"] == 1 and fit.duplicate.sum() == 1 and fit.duplicate[-1]
    assert np.array_equal(fit.ref_ns[:-1], ref0) and fit.ref_ns[-1] == ref0[k]


@pytest.mark.parametrize("seed", [1, 2])
def test_online_all_faults_meets_targets(seed: int) -> None:
    """All faults together, 120 s: online P99 <= 1 ms after 10 s, uncertainty covers >= 99 %."""
    streams = generate_family("all", seed, 120.0)
    res = run_online(streams, sync=True, uncertainty=True)
    err = cross_modal_error(streams, res.refs, warmup_s=10.0)
    assert err["all"]["p99"] <= 1.0
    for sid, s in streams.items():
        keep = s.true_ref_ns >= s.true_ref_ns.min() + 10e9
        covered = np.abs(res.refs[sid] - s.true_ref_ns)[keep] <= res.uncertainty[sid][keep]
        assert covered.mean() >= 0.99, sid
    assert res.sets


def test_too_early_keeps_the_ends_and_the_edges_of_a_silence() -> None:
    """A bin needs three neighbours close in source time to be called stamped late: the ends of an
    epoch and the bins after a silence (across which the drift wandered) are kept."""
    xb = np.r_[np.arange(40) * 2e9, 120e9 + np.arange(3) * 2e9]
    yb = np.zeros(xb.size)
    yb[-3:] = -0.5e6  # the offset moved by half a millisecond during the silence
    yb[20] = -0.5e6  # one bin stamped late among honest neighbours
    flagged = _too_early(xb, yb, 2e9, 0.3e6)
    assert np.flatnonzero(flagged).tolist() == [20]


def test_a_held_up_packet_fills_its_hole() -> None:
    """A packet held up behind its successors by more than the reset threshold is mapped as
    `delayed`; it was still received, so the hole it sits in is not a loss."""
    clock = SourceClock("mic0")
    span = 20_000_000
    srcs = list(range(0, 200 * span, span))
    late = srcs.pop(150)
    for k, s in enumerate(srcs):
        clock.observe_span(s, s + span, s + span + 5_000_000 + (1_000 if k % 2 else 0))
    clock.observe_span(late, late + span, srcs[-1] + span + 6_000_000)  # ~1 s after its successor
    clock.close()
    assert clock.counts["delayed"] == 1
    assert clock.counts["gap"] == 0 and clock.counts["lost"] == 0


def test_a_frame_lost_before_the_period_is_known_is_a_gap() -> None:
    """Frames carry no span: the first step between them sets the period, so a frame lost right
    there is only seen at the next step, and still counted."""
    clock = SourceClock("cam0")
    period = 33_366_667
    srcs = [0, *range(2 * period, 300 * period, period)]  # the second frame is lost
    for k, s in enumerate(srcs):
        clock.observe(s, s + 5_000_000 + (1_000 if k % 2 else 0))
    clock.close()
    assert (clock.counts["gap"], clock.counts["lost"]) == (1, 1)
