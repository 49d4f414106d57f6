from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.core.align import AlignedWindow, AsOfJoin, IntervalJoin
from tristream.core.sync import ApproximateTimeSync
from tristream.core.watermark import WatermarkTracker

MS = 1_000_000


def _summary(wins: list[AlignedWindow]) -> list[tuple[int, tuple[tuple[str, tuple[int, ...]], ...], tuple[str, ...], int]]:
    return [
        (w.anchor_ns, tuple(sorted((s, tuple(t for t, _ in m)) for s, m in w.members.items())), w.missing, w.skew_ns)
        for w in wins
    ]


# ---------------------------------------------------------------- watermarks
def test_watermark_lateness_idleness_and_combined() -> None:
    wm = WatermarkTracker(lateness_ns=10, idle_timeout_ns=100)
    assert wm.observe("cam", 1000, now_ns=0)
    assert wm.observe("mic", 500, now_ns=0)
    assert wm.combined(now_ns=0) == 490  # min over active streams
    assert wm.observe("mic", 995, now_ns=50)
    assert wm.combined(now_ns=50) == 985
    assert not wm.observe("mic", 900, now_ns=60)  # older than mic's watermark: late, counted
    assert wm.counts["late:mic"] == 1
    # cam goes silent: after the idleness timeout it no longer holds mic back
    for k in range(1, 5):
        wm.observe("mic", 995 + k * 100, now_ns=50 + k * 40)
    assert wm.active(now_ns=210) == ["mic"]
    assert wm.combined(now_ns=210) == 1385
    assert wm.combined(now_ns=0) == 1385  # never goes back
    wm.close("mic")
    assert wm.watermark("mic") > 10**18


# ---------------------------------------------------------------- approximate time: golden timelines
def _feed(sync: ApproximateTimeSync, events: list[tuple[str, int]]) -> list[AlignedWindow]:
    out: list[AlignedWindow] = []
    for k, (s, t) in enumerate(events):
        out += sync.push(s, t, f"{s}@{t}", now_ns=k)
    return out + sync.flush()


def test_golden_two_streams() -> None:
    sync = ApproximateTimeSync(["a", "b"], max_interval_ns=30, lateness_ns=0, idle_timeout_ns=10**9)
    ev = [("a", 0), ("b", 4), ("a", 33), ("b", 37), ("a", 66), ("b", 69), ("b", 100), ("a", 101)]
    wins = _feed(sync, ev)
    assert _summary(wins) == [
        (4, (("a", (0,)), ("b", (4,))), (), 4),
        (37, (("a", (33,)), ("b", (37,))), (), 4),
        (69, (("a", (66,)), ("b", (69,))), (), 3),
        (101, (("a", (101,)), ("b", (100,))), (), 1),
    ]
    assert sync.counts.total == 0


def test_golden_three_streams_min_spread_and_unmatched() -> None:
    # b runs at twice the rate; the member closest to the set is chosen, the other is unmatched.
    sync = ApproximateTimeSync(["a", "b", "c"], max_interval_ns=20, lateness_ns=0, idle_timeout_ns=10**9)
    ev = [("a", 0), ("b", 1), ("c", 3), ("b", 16), ("a", 30), ("b", 31), ("c", 29), ("b", 46), ("b", 61),
          ("a", 60), ("c", 62)]
    wins = _feed(sync, ev)
    assert _summary(wins) == [
        (3, (("a", (0,)), ("b", (1,)), ("c", (3,))), (), 3),
        (30, (("a", (30,)), ("b", (31,)), ("c", (29,))), (), 2),
        (62, (("a", (60,)), ("b", (61,)), ("c", (62,))), (), 2),
    ]
    assert sync.counts["unmatched:b"] == 2  # 16 and 46 fit no set


def test_golden_missing_stream_and_max_interval() -> None:
    sync = ApproximateTimeSync(["cam", "mic"], max_interval_ns=10, lateness_ns=0, idle_timeout_ns=10**9)
    ev = [("cam", 0), ("mic", 2), ("cam", 100), ("mic", 300), ("cam", 301)]
    wins = _feed(sync, ev)
    # ROS semantics: cam@100 has no mic message within max_interval and a later pivot exists,
    # so it is counted unmatched; a stream is reported missing when nothing can still come.
    assert _summary(wins) == [
        (2, (("cam", (0,)), ("mic", (2,))), (), 2),
        (301, (("cam", (301,)), ("mic", (300,))), (), 1),
    ]
    assert sync.counts.snapshot() == {"unmatched:cam": 1}
    tail = _feed(ApproximateTimeSync(["cam", "mic"], max_interval_ns=10, lateness_ns=0), [("cam", 5)])
    assert _summary(tail) == [(5, (("cam", (5,)),), ("mic",), 0)]


def test_age_penalty_prefers_older_members() -> None:
    ev = [("a", 100), ("b", 92), ("b", 107)]
    plain = _feed(ApproximateTimeSync(["a", "b"], max_interval_ns=50, lateness_ns=0), list(ev))
    aged = _feed(ApproximateTimeSync(["a", "b"], max_interval_ns=50, age_penalty=1.0, lateness_ns=0), list(ev))
    assert plain[0].members["b"][0][0] == 107  # spread 7 beats 8
    assert aged[0].members["b"][0][0] == 92  # 8 < 7 * 2


def test_idle_stream_does_not_stall() -> None:
    sync = ApproximateTimeSync(["cam", "mic"], max_interval_ns=10 * MS, lateness_ns=0, idle_timeout_ns=100 * MS)
    out: list[AlignedWindow] = []
    out += sync.push("cam", 0, "c0", now_ns=0)
    for k in range(1, 30):  # camera goes silent; mic keeps going every 20 ms
        out += sync.push("mic", k * 20 * MS, f"m{k}", now_ns=k * 20 * MS)
    assert len(out) >= 20
    assert all(w.missing == ("cam",) for w in out[1:])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_sync_invariant_to_arrival_order_within_lateness(data: st.DataObject) -> None:
    n_streams = data.draw(st.integers(2, 4))
    names = [f"s{i}" for i in range(n_streams)]
    events = []
    for s in names:
        times = data.draw(st.lists(st.integers(0, 2000), min_size=0, max_size=25, unique=True))
        events += [(s, t) for t in sorted(times)]
    events.sort(key=lambda e: (e[1], e[0]))
    lateness = 200
    shuffled = list(events)
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    # perturb arrival order: each event may arrive up to `lateness` later than in time order
    keyed = sorted(shuffled, key=lambda e: e[1] + rng.uniform(0, lateness * 0.99))

    def run(evs: list[tuple[str, int]]) -> tuple:  # type: ignore[type-arg]
        sync = ApproximateTimeSync(names, max_interval_ns=60, lateness_ns=lateness, idle_timeout_ns=10**12)
        return _summary(_feed(sync, evs)), sync.counts.snapshot()

    assert run(events) == run(keyed)


# ---------------------------------------------------------------- interval and as-of joins
def test_interval_join_golden() -> None:
    j = IntervalJoin("video", before_ns=5, after_ns=5, lateness_ns=0)
    out: list[AlignedWindow] = []
    for t in range(0, 200, 33):
        out += j.push(t, f"f{t}", now_ns=t)
    out += j.push_segment(40, 100, "utt1", now_ns=200)
    out += j.push_segment(150, 160, "utt2", now_ns=200)
    out += j.push_segment(172, 175, "utt3", now_ns=200)
    out += j.flush()
    assert [(w.anchor_ns, [t for t, _ in w.members.get("video", [])], w.missing) for w in out] == [
        (40, [66, 99], ()),
        (150, [165], ()),
        (172, [], ("video",)),
    ]
    assert out[0].skew_ns == 100 - 40


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 1000), unique=True, max_size=40),
       st.lists(st.tuples(st.integers(0, 900), st.integers(0, 100)), max_size=8), st.randoms())
def test_interval_join_matches_brute_force_any_order(frames: list[int], segs: list[tuple[int, int]],
                                                     rnd: random.Random) -> None:
    def run(fr: list[int]) -> list:  # type: ignore[type-arg]
        j = IntervalJoin("video", before_ns=7, after_ns=3, lateness_ns=10**6)
        out: list[AlignedWindow] = []
        for s, d in segs:
            out += j.push_segment(s, s + d, (s, d), now_ns=0)
        for t in fr:
            out += j.push(t, t, now_ns=0)
        out += j.flush()
        return sorted((w.anchor_ns, w.members["segment"][1][0], tuple(t for t, _ in w.members.get("video", [])))
                      for w in out)

    shuffled = list(frames)
    rnd.shuffle(shuffled)
    expect = sorted((s, s + d, tuple(sorted(t for t in frames if s - 7 <= t <= s + d + 3))) for s, d in segs)
    assert run(sorted(frames)) == expect
    assert run(shuffled) == expect


def test_asof_join() -> None:
    j = AsOfJoin("video", tolerance_ns=40, lateness_ns=10)
    out: list[AlignedWindow] = []
    out += j.push(0, "f0", now_ns=0)
    out += j.push(33, "f33", now_ns=1)
    out += j.push_left(50, "tok1", now_ns=2)  # must wait: a frame in (33, 50] could still come
    assert out == []
    out += j.push(45, "f45", now_ns=3)
    out += j.push(70, "f70", now_ns=4)  # watermark 60 >= 50: decided, and it sees f45
    assert [(w.anchor_ns, w.members["video"][0][0], w.skew_ns) for w in out] == [(50, 45, 5)]
    out += j.push_left(200, "tok2", now_ns=5)
    out += j.flush()
    assert out[-1].missing == ("video",)
    with pytest.raises(KeyError):
        j.push_left(1, "x", 0) and j.q.push("audio", 1, None, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1000), unique=True, max_size=40), st.lists(st.integers(0, 1000), max_size=15),
       st.randoms())
def test_asof_join_matches_brute_force_any_order(frames: list[int], queries: list[int], rnd: random.Random) -> None:
    lateness = 300

    def run(order: list[tuple[str, int]]) -> list[tuple[int, int | None]]:
        j = AsOfJoin("video", tolerance_ns=50, lateness_ns=lateness, idle_timeout_ns=10**12)
        out: list[AlignedWindow] = []
        for k, (kind, t) in enumerate(order):
            out += j.push_left(t, t, now_ns=k) if kind == "q" else j.push(t, t, now_ns=k)
        out += j.flush()
        return sorted((w.anchor_ns, w.members["video"][0][0] if "video" in w.members else None) for w in out)

    events = sorted([("f", t) for t in frames] + [("q", t) for t in queries], key=lambda e: e[1])
    # every event may arrive up to `lateness` after its time-ordered slot
    shuffled = sorted(events, key=lambda e: e[1] + rnd.uniform(0, lateness * 0.99))
    expect = []
    for q in queries:
        before = [f for f in frames if f <= q and q - f <= 50]
        expect.append((q, max(before) if before else None))
    assert run(events) == sorted(expect)
    assert run(shuffled) == sorted(expect)
