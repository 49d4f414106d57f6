"""Modality-aware KV retention policy over block metadata."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tristream.vision.retention import (
    TEXT,
    VISION,
    AttentionMass,
    KVBlockInfo,
    ModalityAwareRetention,
    modality_of_keys,
)

BS = 16


def ctx(spec: str, masses: dict[int, float] | None = None) -> list[KVBlockInfo]:
    """'ttvvvt' → blocks of 16 tokens, id = index."""
    masses = masses or {}
    return [KVBlockInfo(i, i * BS, BS, VISION if c == "v" else TEXT, masses.get(i, 0.0)) for i, c in enumerate(spec)]


def test_under_budget_evicts_nothing() -> None:
    assert ModalityAwareRetention().plan(ctx("ttvvt"), 5).evict == []


def test_vision_blocks_go_first_lowest_attention_first() -> None:
    pol = ModalityAwareRetention(sink_tokens=4, text_window_tokens=32)
    blocks = ctx("tvvvvttt", {1: 0.5, 2: 0.01, 3: 0.3, 4: 0.02})
    plan = pol.plan(blocks, 6)
    assert plan.evict == [2, 4] and plan.reasons == {"vision_low_attention": 2} and plan.shortfall == 0


def test_text_sliding_window_keeps_sinks_and_recent_text() -> None:
    pol = ModalityAwareRetention(sink_tokens=4, text_window_tokens=32)
    plan = pol.plan(ctx("ttttttt"), 4)
    # block 0 holds the sinks, blocks 5-6 are the 32-token window: evict the oldest others
    assert plan.evict == [1, 2, 3]
    assert plan.reasons == {"text_outside_window": 3}


def test_mixed_context_vision_then_text() -> None:
    pol = ModalityAwareRetention(sink_tokens=4, text_window_tokens=16)
    plan = pol.plan(ctx("tvvttvtt", {1: 0.9, 2: 0.1, 5: 0.5}), 3)
    assert plan.evict[:3] == [2, 5, 1] and plan.evict[3:] == [3, 4]
    assert pol.evicted == {"vision_low_attention": 3, "text_outside_window": 2}


def test_shortfall_is_reported_not_hidden() -> None:
    pol = ModalityAwareRetention(sink_tokens=16, text_window_tokens=64)
    plan = pol.plan(ctx("ttttt"), 1)
    assert plan.evict == [] and plan.shortfall == 4


def test_min_vision_blocks_floor() -> None:
    pol = ModalityAwareRetention(sink_tokens=0, text_window_tokens=1000, min_vision_blocks=2)
    plan = pol.plan(ctx("vvvvt"), 1)
    assert len(plan.evict) == 2 and plan.shortfall == 2


def test_attention_mass_accumulates_with_decay_per_block() -> None:
    am = AttentionMass(decay=0.5)
    blocks_of_pos = np.array([0, 0, 1, 1, 2])
    am.observe(blocks_of_pos, np.array([0.1, 0.1, 0.3, 0.3, 0.2]))
    am.observe(blocks_of_pos, np.array([0.0, 0.0, 0.0, 0.5, 0.5]))
    assert am.mass[0] == pytest.approx(0.1)
    assert am.mass[1] == pytest.approx(0.3 + 0.5)
    assert am.mass[2] == pytest.approx(0.1 + 0.5)
    blocks = ctx("tvv")
    am.annotate(blocks)
    assert [b.attention_mass for b in blocks] == pytest.approx([0.1, 0.8, 0.6])


def test_modality_from_engine_keys_and_the_plan_keeps_sinks_and_the_window() -> None:
    keys = [[1, 2, 3, 4], [-5, -6, -7, -8], [-9, -10, -11, -12], [5, 6, 7, 8], [9, 10, 11, 12]]
    blocks = [KVBlockInfo(10 + i, i * 4, 4, modality_of_keys(k), float(i)) for i, k in enumerate(keys)]
    assert [b.modality for b in blocks] == [TEXT, VISION, VISION, TEXT, TEXT]
    plan = ModalityAwareRetention(sink_tokens=4, text_window_tokens=4).plan(blocks, 3)
    assert sorted(plan.evict) == [11, 12]


@given(st.text(alphabet="tv", min_size=1, max_size=40), st.integers(0, 40),
       st.lists(st.floats(0, 1), min_size=40, max_size=40))
def test_policy_invariants(spec: str, budget: int, masses: list[float]) -> None:
    pol = ModalityAwareRetention(sink_tokens=4, text_window_tokens=48)
    blocks = ctx(spec, dict(enumerate(masses)))
    plan = pol.plan(blocks, budget)
    ev = set(plan.evict)
    assert len(ev) == len(plan.evict)
    assert len(blocks) - len(ev) == max(budget, 0) + plan.shortfall or len(blocks) <= budget
    assert 0 not in ev and blocks[-1].block_id not in ev  # sinks and the block being written stay
    vis = [b for b in blocks if b.block_id in ev and b.modality == VISION]
    txt = [b for b in blocks if b.block_id in ev and b.modality == TEXT]
    if txt:  # text only goes once no evictable vision block is left
        assert all(b.block_id in ev or b.first_pos < 4 or b is blocks[-1]
                   for b in blocks if b.modality == VISION)
    kept_vis = [b for b in blocks if b.modality == VISION and b.block_id not in ev and b.first_pos >= 4
                and b is not blocks[-1]]
    if vis and kept_vis:
        assert max(b.attention_mass for b in vis) <= min(b.attention_mass for b in kept_vis)
