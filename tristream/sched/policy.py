"""Ordering policy: which queued item runs first.

Each item gets a *base rank* from its (tier, modality) class — 0 is the most important;
an end of turn is its own class at the top of its tier —
then the sort key `(base_rank - floor(wait / A), effective_deadline, arrival, id)`:

* priority by SLA tier and by modality (order configurable: tier-major by default, so
  gold text still beats silver speech; `modality_major` flips it);
* EDF inside one class (earliest deadline first);
* aging: every `A` ms of waiting lifts an item one rank, without limit;
* slack: a decode token still ahead of its answer's pace takes the last rank (it has slack);
* buffer-watermark weights: a session whose input ring fills gets its deadlines pulled in
  (`deadline - w * fill * (deadline - arrival)`), so it is served earlier within its rank.

Aging bound (proof). Let K be the number of base ranks (0..K-1) and A the aging step.
Item j can sort ahead of item i at time t only if eff_j <= eff_i, i.e.
`b_j - floor((t-a_j)/A) <= b_i - floor((t-a_i)/A)`. With 0 <= b <= K-1 this gives
`floor((t-a_j)/A) >= floor((t-a_i)/A) - (K-1)`, hence `(t-a_j)/A > (t-a_i)/A - K`, i.e.
`a_j < a_i + K*A`. So *every* item that is ever ahead of i arrived before `a_i + K*A`:
later arrivals can never overtake it, whatever their tier. If each engine step serves
the head of the queue (the batcher guarantees it), i is served after at most
`Q(a_i) + N(a_i, a_i + K*A)` other head-of-line steps, where Q is the queue length when i
arrived and N the admissions in the window — both bounded by admission control, so
i's wait is at most `(Q_max + N_max + 1) * S_max` with S_max the longest step. The
watermark pull-in only moves the deadline, the secondary key, and keeps the bound.
Items demoted by a DELAY timeout stop aging (they yield to all other work, as Triton's
DELAY allows) and are outside the bound; a TURN_END absorbs its session's delayed prefill.
`tests/sched/test_policy.py` checks the "no later overtaker" property with hypothesis.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tristream.sched.types import MS, Kind, Tier, WorkItem, WorkModality


class Ordering(StrEnum):
    """How items are ranked (ours and the two baselines)."""

    TIER_MAJOR = "tier_major"
    """(tier, modality) classes, tier first; EDF + aging inside."""
    MODALITY_MAJOR = "modality_major"
    """(modality, tier) classes, modality first; EDF + aging inside."""
    STATIC_TIER = "static_tier"
    """Triton-like static priority levels = tier, FIFO inside a level, no aging."""
    FIFO = "fifo"
    """Arrival order only."""


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Knobs of the ordering policy."""

    ordering: Ordering = Ordering.TIER_MAJOR
    modality_order: tuple[WorkModality, ...] = (WorkModality.SPEECH, WorkModality.VISION, WorkModality.TEXT)
    tier_order: tuple[Tier, ...] = (Tier.GOLD, Tier.SILVER, Tier.BRONZE)
    aging_step_ms: float | None = 500.0
    """A: waiting this long lifts an item one rank; None disables aging. Keep K*A above the
    REJECT timeouts so that, under overload, low tiers are shed before they age past gold."""
    watermark_weight: float = 0.5
    """w in [0, 1]: how far a full input ring pulls deadlines towards arrival."""
    turn_end_first: bool = True
    """An end of turn (the item whose completion is the first answer token) ranks above every
    other item of its tier, whatever its modality."""
    yield_ahead_of_pace: bool = True
    """A decode token due more than `pace_slack_ms` from now takes the last rank: an answer
    ahead of its reading/speaking pace has slack and yields to any end of turn."""
    pace_slack_ms: float = 60.0
    """How early a decode token regains its class rank (two to three steps, so it is not late)."""
    global_turn_ends: bool = True
    """Rank the ends of turn of *all* tiers (in tier order) above every other item: they are
    the cheapest work with the most user-visible latency, so under overload every tier keeps
    fast first tokens and the rest of the lower tiers' work (answer pace, frames) gives."""

    def __post_init__(self) -> None:
        if sorted(self.modality_order) != sorted(WorkModality):
            raise ValueError(f"modality_order must list each modality once, got {self.modality_order}")
        if sorted(self.tier_order) != sorted(Tier):
            raise ValueError(f"tier_order must list each tier once, got {self.tier_order}")
        if not 0.0 <= self.watermark_weight <= 1.0:
            raise ValueError(f"watermark_weight must be in [0, 1], got {self.watermark_weight}")
        if self.aging_step_ms is not None and self.aging_step_ms <= 0:
            raise ValueError(f"aging_step_ms must be > 0 or None, got {self.aging_step_ms}")


class PriorityPolicy:
    """Computes sort keys; lower key = served first."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        c = self.config
        self._tier_pos = {t: i for i, t in enumerate(c.tier_order)}
        self._mod_pos = {m: i for i, m in enumerate(c.modality_order)}
        self._aging_ns = None if c.aging_step_ms is None else int(c.aging_step_ms * MS)
        self._slack_ns = int(c.pace_slack_ms * MS)

    @property
    def num_ranks(self) -> int:
        """K: number of base ranks."""
        o = self.config.ordering
        if o is Ordering.FIFO:
            return 1
        if o is Ordering.STATIC_TIER:
            return len(Tier)
        return len(Tier) * self._per_tier + (len(Tier) if self.config.global_turn_ends else 0)

    @property
    def _per_tier(self) -> int:
        return len(WorkModality) + (1 if self.config.turn_end_first else 0)

    def base_rank(self, item: WorkItem) -> int:
        """Rank of the item's class before aging (DELAY-demoted items get the last rank)."""
        if item.delayed:
            return self.num_ranks - 1
        o = self.config.ordering
        if o is Ordering.FIFO:
            return 0
        t, m = self._tier_pos[item.tier], self._mod_pos[item.modality]
        if o is Ordering.STATIC_TIER:
            return t
        if self.config.global_turn_ends and item.kind is Kind.TURN_END:
            return t
        offset = len(Tier) if self.config.global_turn_ends else 0
        if self.config.turn_end_first:
            m = 0 if item.kind is Kind.TURN_END else m + 1
        if o is Ordering.TIER_MAJOR:
            return offset + t * self._per_tier + m
        return offset + m * len(Tier) + t

    def effective_rank(self, item: WorkItem, now_ns: int) -> int:
        """Base rank lifted by aging (may go below 0: old items overtake fresh gold ones)."""
        b = self.base_rank(item)
        if self.config.yield_ahead_of_pace and item.kind is Kind.DECODE and item.deadline_ns > now_ns + self._slack_ns:
            b = self.num_ranks - 1
        if item.delayed or self._aging_ns is None or self.config.ordering in (Ordering.FIFO, Ordering.STATIC_TIER):
            return b
        return b - max(0, now_ns - item.arrival_ns) // self._aging_ns

    def effective_deadline(self, item: WorkItem, fill: float) -> int:
        """Deadline pulled towards arrival by the session's input-ring fill ratio."""
        if fill <= 0.0:
            return item.deadline_ns
        slack = max(0, item.deadline_ns - item.arrival_ns)
        return item.deadline_ns - int(self.config.watermark_weight * min(1.0, fill) * slack)

    def key(self, item: WorkItem, now_ns: int, fill: float = 0.0) -> tuple[int, int, int, int]:
        """Sort key of `item` at `now_ns` given its session's ring fill."""
        o = self.config.ordering
        if o is Ordering.FIFO:
            return (0, item.arrival_ns, item.item_id, 0)
        if o is Ordering.STATIC_TIER:
            return (self.base_rank(item), item.arrival_ns, item.item_id, 0)
        return (
            self.effective_rank(item, now_ns),
            self.effective_deadline(item, fill),
            item.arrival_ns,
            item.item_id,
        )

    def order(self, items: list[WorkItem], now_ns: int, fills: dict[int, float] | None = None) -> list[WorkItem]:
        """Items sorted best-first."""
        f = fills or {}
        return sorted(items, key=lambda it: self.key(it, now_ns, f.get(it.session_id, 0.0)))
