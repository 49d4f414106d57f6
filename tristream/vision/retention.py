"""Modality-aware KV retention: which cache blocks of a context to evict when it exceeds its budget.

Vision-token blocks go first, lowest accumulated attention mass first (the image regions the
decoder stopped looking at); then text blocks leave by a sliding window: the oldest text outside
the most recent `text_window_tokens` goes, but the first `sink_tokens` positions (attention
sinks) and the block being written always stay. The policy works on block metadata only; it
hands the LLM engine's block manager the ids to `release` and never touches tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

VISION = "vision"
TEXT = "text"


def modality_of_keys(keys: Sequence[int]) -> str:
    """A block is vision when every position holds a precomputed embedding (negative key), else text."""
    return VISION if keys and all(k < 0 for k in keys) else TEXT


@dataclass(slots=True)
class KVBlockInfo:
    """One block of a context: id, position of its first token, modality, tokens and attention mass."""

    block_id: int
    first_pos: int
    n_tokens: int
    modality: str
    attention_mass: float = 0.0


@dataclass(slots=True)
class EvictionPlan:
    """Blocks to free, counted by reason; `shortfall` > 0 means the budget cannot be met by eviction."""

    evict: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    shortfall: int = 0

    def add(self, block_id: int, reason: str) -> None:
        self.evict.append(block_id)
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


class AttentionMass:
    """Exponentially decayed attention mass per block, from decode-step attention over positions."""

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1); got {decay}")
        self.decay = decay
        self.mass: dict[int, float] = {}

    def observe(self, block_of_position: np.ndarray, probs: np.ndarray) -> None:
        """Fold in one step's attention `probs` [n_positions] (heads/layers averaged) by block id."""
        if block_of_position.shape != probs.shape:
            raise ValueError(f"block ids {block_of_position.shape} and probs {probs.shape} differ in shape")
        ids, inv = np.unique(block_of_position, return_inverse=True)
        sums = np.bincount(inv, weights=probs.astype(np.float64))
        for k in self.mass:
            self.mass[k] *= self.decay
        for b, s in zip(ids.tolist(), sums.tolist(), strict=True):
            self.mass[b] = self.mass.get(b, 0.0) + s

    def annotate(self, blocks: list[KVBlockInfo]) -> None:
        """Copy the tracked mass into block metadata."""
        for b in blocks:
            b.attention_mass = self.mass.get(b.block_id, 0.0)

    def forget(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.mass.pop(b, None)


@dataclass(slots=True)
class ModalityAwareRetention:
    """Eviction policy: vision by attention mass, then text by sliding window with sink tokens."""

    sink_tokens: int = 4
    text_window_tokens: int = 1024
    min_vision_blocks: int = 0
    evicted: dict[str, int] = field(default_factory=dict)

    def plan(self, blocks: list[KVBlockInfo], budget_blocks: int) -> EvictionPlan:
        """Choose blocks so that at most `budget_blocks` remain; blocks are in context order."""
        plan = EvictionPlan()
        need = len(blocks) - budget_blocks
        if need <= 0:
            return plan
        last = blocks[-1].block_id if blocks else None

        def protected(b: KVBlockInfo) -> bool:
            return b.first_pos < self.sink_tokens or b.block_id == last

        vision = [b for b in blocks if b.modality == VISION and not protected(b)]
        n_vision = sum(1 for b in blocks if b.modality == VISION)
        budget_v = max(0, min(len(vision), n_vision - self.min_vision_blocks))
        for b in sorted(vision, key=lambda b: (b.attention_mass, b.first_pos))[: min(need, budget_v)]:
            plan.add(b.block_id, "vision_low_attention")
        need -= len(plan.evict)
        if need > 0:
            text = [b for b in blocks if b.modality == TEXT]
            kept_recent = 0
            window: set[int] = set()
            for b in reversed(text):
                if kept_recent >= self.text_window_tokens:
                    break
                window.add(b.block_id)
                kept_recent += b.n_tokens
            for b in text:
                if need == 0:
                    break
                if protected(b) or b.block_id in window:
                    continue
                plan.add(b.block_id, "text_outside_window")
                need -= 1
        plan.shortfall = need
        for r, n in plan.reasons.items():
            self.evicted[r] = self.evicted.get(r, 0) + n
        return plan
