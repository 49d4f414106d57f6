"""Packs ordered work into one engine step that fits the captured buckets and the budgets.

Limits: a per-step prefill-token budget, the largest captured bucket per kind (decode 128,
images 32, ASR windows 16), and the controller's step budget
in modelled milliseconds. The head item is always taken (clipped to the token budget) so
every step makes progress on the most urgent work — the aging bound relies on it. Prefill
is chunked: a long prompt takes what fits and stays queued with the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tristream.sched.steptime import (
    ASR_BUCKETS,
    DECODE_BUCKETS,
    IMAGE_BUCKETS,
    CalibratedStepTime,
    StepTimeModel,
    bucket_for,
)
from tristream.sched.types import Kind, WorkItem


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """Hard per-step limits."""

    token_budget: int = 512
    """Prefill tokens per step (the engine's `max_prefill_tokens`); decode slots are counted
    by `max_decode` (the engine's `max_batch`), as the engine does."""
    max_decode: int = DECODE_BUCKETS[-1]
    max_images: int = IMAGE_BUCKETS[-1]
    max_asr: int = ASR_BUCKETS[-1]
    min_prefill_chunk: int = 16
    free_ms: float = 0.1
    """An item whose modelled marginal cost is at most this joins even a step already at its
    budget (a decode slot inside the same bucket costs nothing): the budget bounds step time,
    it must not starve near-free work behind big fixed costs."""

    def __post_init__(self) -> None:
        if self.max_decode > DECODE_BUCKETS[-1] or self.max_images > IMAGE_BUCKETS[-1] or self.max_asr > ASR_BUCKETS[-1]:
            raise ValueError("batch limits exceed the largest captured bucket")
        if self.token_budget < 1 or self.min_prefill_chunk < 1:
            raise ValueError("token_budget and min_prefill_chunk must be >= 1")


@dataclass(slots=True)
class PlanEntry:
    """One item in a step; `tokens` = prefill tokens taken now (1 for decode)."""

    item: WorkItem
    tokens: int
    asr_units: int
    images: int

    @property
    def completes(self) -> bool:
        """Whether this step finishes the item (all remaining prefill taken)."""
        return self.item.kind not in (Kind.PREFILL, Kind.TURN_END) or self.tokens >= self.item.tokens


@dataclass(slots=True)
class BatchPlan:
    """The content of one engine step."""

    entries: list[PlanEntry] = field(default_factory=list)
    decode: int = 0
    prefill_tokens: int = 0
    images: int = 0
    asr_units: int = 0
    est_ms: float = 0.0
    budget_ms: float = 0.0

    @property
    def empty(self) -> bool:
        """No work at all."""
        return not self.entries

    @property
    def decode_bucket(self) -> int:
        """Captured decode graph this step replays."""
        return bucket_for(self.decode, DECODE_BUCKETS)

    @property
    def tokens(self) -> int:
        """Decode + prefill tokens."""
        return self.decode + self.prefill_tokens


class Batcher:
    """Greedy packer over an already ordered candidate list."""

    def __init__(self, model: StepTimeModel | CalibratedStepTime, limits: BatchLimits | None = None) -> None:
        self.model = model
        self.limits = limits or BatchLimits()

    def build(self, ordered: Iterable[WorkItem], budget_ms: float,
              sticky: Iterable[WorkItem] = (), due_before_ns: int | None = None) -> BatchPlan:
        """Pack `sticky` items (non-preemptible running decodes) first, then `ordered`.

        Decode tokens due before `due_before_ns` (behind their answer's pace) are limited by
        decode slots only, not by the step budget: a late answer token is a stall the user
        hears, as much as a late first token.
        """
        lim, m = self.limits, self.model
        plan = BatchPlan(budget_ms=budget_ms)
        taken: set[int] = set()
        for it in sticky:
            if plan.decode >= lim.max_decode:
                break
            self._add(plan, it, 1, 0, 0)
            taken.add(it.item_id)
        for it in ordered:
            if it.item_id in taken:
                continue
            head = plan.empty
            d, pf, im, asr = plan.decode, plan.prefill_tokens, plan.images, plan.asr_units
            now_ms = m.step_ms(d, pf, im, asr)

            def fits(new_ms: float, head: bool = head, now_ms: float = now_ms) -> bool:
                return head or new_ms <= budget_ms or new_ms - now_ms <= lim.free_ms

            room = lim.token_budget - plan.prefill_tokens
            if it.kind is Kind.DECODE:
                if d >= lim.max_decode:
                    continue
                due = due_before_ns is not None and it.deadline_ns <= due_before_ns
                if due or fits(m.step_ms(d + 1, pf, im, asr)):
                    self._add(plan, it, 1, 0, 0)
            elif it.kind is Kind.VISION_FRAME:
                if im + it.images > lim.max_images:
                    continue
                if fits(m.step_ms(d, pf, im + it.images, asr)):
                    self._add(plan, it, 0, 0, it.images)
            elif it.kind is Kind.ASR_CHUNK:
                if asr + it.asr_units > lim.max_asr:
                    continue
                if fits(m.step_ms(d, pf, im, asr + it.asr_units)):
                    self._add(plan, it, 0, it.asr_units, 0)
            else:  # PREFILL / TURN_END: chunked
                a = it.asr_units
                if asr + a > lim.max_asr or (room < 1 and it.tokens > 0):
                    continue
                take = min(it.tokens, room)
                if not head:
                    take = self._fit_tokens(plan, it, take, budget_ms)
                    if take < 0:
                        continue
                self._add(plan, it, take, a, 0)
        plan.est_ms = m.step_ms(plan.decode, plan.prefill_tokens, plan.images, plan.asr_units)
        return plan

    def _fit_tokens(self, plan: BatchPlan, it: WorkItem, take: int, budget_ms: float) -> int:
        """Largest prefill chunk (<= take) that keeps the step within budget; -1 if none."""
        m = self.model
        d, pf, im, asr = plan.decode, plan.prefill_tokens, plan.images, plan.asr_units + it.asr_units
        if m.step_ms(d, pf + take, im, asr) <= budget_ms:
            return take
        lo, hi = 0, take
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if m.step_ms(d, pf + mid, im, asr) <= budget_ms:
                lo = mid
            else:
                hi = mid - 1
        if lo < min(self.limits.min_prefill_chunk, it.tokens) or (lo == 0 and it.tokens > 0):
            return -1
        return lo

    @staticmethod
    def _add(plan: BatchPlan, it: WorkItem, tokens: int, asr: int, images: int) -> None:
        plan.entries.append(PlanEntry(it, tokens, asr, images))
        if it.kind is Kind.DECODE:
            plan.decode += 1
        else:
            plan.prefill_tokens += tokens
        plan.asr_units += asr
        plan.images += images
