from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.sched.policy import Ordering, PolicyConfig, PriorityPolicy
from tristream.sched.types import MS, Kind, Tier, WorkItem, WorkModality

_ids = iter(range(1, 10**9))


def item(tier: Tier, modality: WorkModality, kind: Kind = Kind.ASR_CHUNK, arrival_ms: float = 0.0,
         deadline_ms: float = 100.0, sid: int = 0) -> WorkItem:
    return WorkItem(next(_ids), sid, tier, modality, kind, int(arrival_ms * MS), int(deadline_ms * MS))


def test_tier_then_modality_order() -> None:
    pol = PriorityPolicy(PolicyConfig(aging_step_ms=None))
    items = [
        item(Tier.BRONZE, WorkModality.SPEECH),
        item(Tier.GOLD, WorkModality.TEXT, Kind.PREFILL),
        item(Tier.SILVER, WorkModality.VISION, Kind.VISION_FRAME),
        item(Tier.GOLD, WorkModality.SPEECH),
        item(Tier.GOLD, WorkModality.VISION, Kind.VISION_FRAME),
        item(Tier.SILVER, WorkModality.SPEECH),
    ]
    got = [(it.tier, it.modality) for it in pol.order(items, 0)]
    assert got == [
        (Tier.GOLD, WorkModality.SPEECH), (Tier.GOLD, WorkModality.VISION), (Tier.GOLD, WorkModality.TEXT),
        (Tier.SILVER, WorkModality.SPEECH), (Tier.SILVER, WorkModality.VISION), (Tier.BRONZE, WorkModality.SPEECH),
    ]


def test_modality_order_is_configurable() -> None:
    cfg = PolicyConfig(ordering=Ordering.MODALITY_MAJOR, aging_step_ms=None,
                       modality_order=(WorkModality.VISION, WorkModality.SPEECH, WorkModality.TEXT))
    pol = PriorityPolicy(cfg)
    a = item(Tier.GOLD, WorkModality.SPEECH)
    b = item(Tier.BRONZE, WorkModality.VISION, Kind.VISION_FRAME)
    c = item(Tier.GOLD, WorkModality.VISION, Kind.VISION_FRAME)
    assert pol.order([a, b, c], 0) == [c, b, a]


def test_turn_end_ranks_first_in_its_tier_and_gold_turn_end_beats_bronze_decode() -> None:
    pol = PriorityPolicy(PolicyConfig(aging_step_ms=None))
    asr = item(Tier.GOLD, WorkModality.SPEECH, Kind.ASR_CHUNK, deadline_ms=1)
    te = item(Tier.GOLD, WorkModality.TEXT, Kind.TURN_END, deadline_ms=50)
    bronze_decode = item(Tier.BRONZE, WorkModality.TEXT, Kind.DECODE, deadline_ms=-1)  # behind its pace
    assert pol.order([bronze_decode, asr, te], 0) == [te, asr, bronze_decode]


def test_decode_ahead_of_pace_yields_to_any_turn_end() -> None:
    ahead = item(Tier.GOLD, WorkModality.TEXT, Kind.DECODE, deadline_ms=100)
    behind = item(Tier.GOLD, WorkModality.TEXT, Kind.DECODE, deadline_ms=35)  # due within the 30 ms slack
    bronze_te = item(Tier.BRONZE, WorkModality.SPEECH, Kind.TURN_END, deadline_ms=500)
    now = 10 * MS
    local = PriorityPolicy(PolicyConfig(aging_step_ms=None, global_turn_ends=False))
    assert local.order([ahead, bronze_te, behind], now) == [behind, bronze_te, ahead]
    default = PriorityPolicy(PolicyConfig(aging_step_ms=None))
    assert default.order([ahead, bronze_te, behind], now) == [bronze_te, behind, ahead]


def test_global_turn_ends_rank_above_all_other_work_in_tier_order() -> None:
    pol = PriorityPolicy(PolicyConfig(aging_step_ms=None))
    g_asr = item(Tier.GOLD, WorkModality.SPEECH, Kind.ASR_CHUNK, deadline_ms=1)
    s_te = item(Tier.SILVER, WorkModality.TEXT, Kind.TURN_END, deadline_ms=150)
    b_te = item(Tier.BRONZE, WorkModality.SPEECH, Kind.TURN_END, deadline_ms=10)
    g_te = item(Tier.GOLD, WorkModality.SPEECH, Kind.TURN_END, deadline_ms=50)
    assert pol.order([g_asr, b_te, s_te, g_te], 0) == [g_te, s_te, b_te, g_asr]
    ranks = {pol.base_rank(i) for i in (g_asr, s_te, b_te, g_te)}
    assert max(ranks) < pol.num_ranks


def test_edf_within_a_class() -> None:
    pol = PriorityPolicy(PolicyConfig(aging_step_ms=None))
    late = item(Tier.SILVER, WorkModality.SPEECH, arrival_ms=0, deadline_ms=300)
    early = item(Tier.SILVER, WorkModality.SPEECH, arrival_ms=5, deadline_ms=100)
    mid = item(Tier.SILVER, WorkModality.SPEECH, arrival_ms=2, deadline_ms=200)
    assert pol.order([late, early, mid], 10 * MS) == [early, mid, late]


def test_fifo_and_static_tier_orders() -> None:
    a = item(Tier.BRONZE, WorkModality.TEXT, Kind.PREFILL, arrival_ms=1)
    b = item(Tier.GOLD, WorkModality.VISION, Kind.VISION_FRAME, arrival_ms=2)
    c = item(Tier.GOLD, WorkModality.SPEECH, arrival_ms=3, deadline_ms=4)
    fifo = PriorityPolicy(PolicyConfig(ordering=Ordering.FIFO))
    static = PriorityPolicy(PolicyConfig(ordering=Ordering.STATIC_TIER))
    assert fifo.order([c, b, a], 10 * MS) == [a, b, c]
    assert static.order([c, b, a], 10 * MS) == [b, c, a]  # tier, then arrival (no modality, no EDF)


def test_aging_lifts_one_rank_per_step() -> None:
    pol = PriorityPolicy(PolicyConfig(aging_step_ms=100.0))
    it = item(Tier.BRONZE, WorkModality.TEXT, Kind.PREFILL, arrival_ms=0)
    b = pol.base_rank(it)
    assert pol.effective_rank(it, 99 * MS) == b
    assert pol.effective_rank(it, 100 * MS) == b - 1
    assert pol.effective_rank(it, 1000 * MS) == b - 10
    # after K*A an old bronze item overtakes a fresh gold end of turn
    now_ms = pol.num_ranks * 100.0 + 1
    now = int(now_ms * MS)
    fresh_gold = item(Tier.GOLD, WorkModality.SPEECH, Kind.TURN_END, arrival_ms=now_ms, deadline_ms=now_ms + 50)
    assert pol.order([fresh_gold, it], now - 200 * MS)[0] is fresh_gold
    assert pol.order([fresh_gold, it], now)[0] is it


def test_watermark_pulls_deadline_in() -> None:
    pol = PriorityPolicy(PolicyConfig(aging_step_ms=None, watermark_weight=0.5))
    a = item(Tier.SILVER, WorkModality.VISION, Kind.VISION_FRAME, arrival_ms=0, deadline_ms=400, sid=1)
    b = item(Tier.SILVER, WorkModality.VISION, Kind.VISION_FRAME, arrival_ms=0, deadline_ms=300, sid=2)
    assert pol.order([a, b], 0) == [b, a]
    assert pol.order([a, b], 0, {1: 1.0}) == [a, b]  # session 1's ring is full: 400 → 200 ms
    assert pol.effective_deadline(a, 1.0) == 200 * MS


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="modality_order"):
        PolicyConfig(modality_order=(WorkModality.SPEECH, WorkModality.SPEECH, WorkModality.TEXT))
    with pytest.raises(ValueError, match="watermark_weight"):
        PolicyConfig(watermark_weight=2.0)
    with pytest.raises(ValueError, match="aging_step_ms"):
        PolicyConfig(aging_step_ms=0.0)


_item_st = st.tuples(
    st.integers(0, 2000),  # arrival ms
    st.sampled_from(list(Tier)),
    st.sampled_from(list(WorkModality)),
    st.sampled_from([Kind.ASR_CHUNK, Kind.VISION_FRAME, Kind.PREFILL, Kind.TURN_END, Kind.DECODE]),
    st.integers(0, 600),  # relative deadline ms
    st.integers(0, 3),  # session
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_item_st, min_size=1, max_size=60), st.integers(1, 40),
       st.dictionaries(st.integers(0, 3), st.floats(0, 1)), st.sampled_from([50.0, 100.0, 250.0]))
def test_aging_bound_no_late_overtaker(specs: list[tuple[int, Tier, WorkModality, Kind, int, int]],
                                      step_ms: int, fills: dict[int, float], aging_ms: float) -> None:
    """Serve the head each step: nobody that arrived after a_i + K*A is ever served before i."""
    pol = PriorityPolicy(PolicyConfig(aging_step_ms=aging_ms))
    items = [item(t, m, k, a, a + d, sid) for a, t, m, k, d, sid in specs]
    horizon = pol.num_ranks * aging_ms * MS
    pending = sorted(items, key=lambda it: it.arrival_ns)
    queue: list[WorkItem] = []
    served_at: dict[int, int] = {}
    order: list[WorkItem] = []
    now = 0
    while pending or queue:
        while pending and pending[0].arrival_ns <= now:
            queue.append(pending.pop(0))
        if not queue:
            now = pending[0].arrival_ns
            continue
        head = pol.order(queue, now, fills)[0]
        queue.remove(head)
        served_at[head.item_id] = now
        order.append(head)
        now += step_ms * MS
    for i in items:
        for j in order:
            if served_at[j.item_id] >= served_at[i.item_id]:
                break
            if served_at[j.item_id] >= i.arrival_ns:
                assert j.arrival_ns < i.arrival_ns + horizon
        # hence the number of items served while i waited is bounded by those arriving before a_i + K*A
        waited = sum(1 for j in order if i.arrival_ns <= served_at[j.item_id] < served_at[i.item_id])
        bound = sum(1 for j in items if j is not i and j.arrival_ns < i.arrival_ns + horizon
                    and served_at[j.item_id] >= i.arrival_ns)
        assert waited <= bound
