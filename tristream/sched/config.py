"""Scheduler configuration, and the presets for ours and the two baselines."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from tristream.sched.admission import LadderConfig, QueuePolicy, default_queue_policies
from tristream.sched.batcher import BatchLimits
from tristream.sched.controller import AIMDConfig
from tristream.sched.policy import Ordering, PolicyConfig
from tristream.sched.session import WorkShape
from tristream.sched.types import DEFAULT_TIERS, Tier, TierSpec


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything that makes one scheduler variant."""

    name: str = "ours"
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    preempt: bool = True
    """Running decodes may be left out of a step (preempted) for more urgent work."""
    adaptive: bool = True
    """Per-tier AIMD controllers set the step budget; otherwise `fixed_budget_ms`."""
    degrade: bool = True
    """The degradation ladder is active."""
    fixed_budget_ms: float = math.inf
    queue: dict[Tier, QueuePolicy] = field(default_factory=default_queue_policies)
    limits: BatchLimits = field(default_factory=BatchLimits)
    aimd: AIMDConfig = field(default_factory=AIMDConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    shape: WorkShape = field(default_factory=WorkShape)
    tiers: dict[Tier, TierSpec] = field(default_factory=lambda: dict(DEFAULT_TIERS))


def ours_config(**overrides: Any) -> SchedulerConfig:
    """Ends of turn first, then tier-major (tier, modality) classes with EDF and aging;
    preemption, AIMD step budget, degradation ladder."""
    return replace(SchedulerConfig(), **overrides)


def _baseline(name: str, ordering: Ordering, **fields: Any) -> SchedulerConfig:
    """A baseline: `ordering` alone (no aging, no watermark pull-in), running decodes never
    preempted, the fixed (largest) step budget, no degradation ladder."""
    return SchedulerConfig(
        name=name,
        policy=PolicyConfig(ordering=ordering, aging_step_ms=None, watermark_weight=0.0),
        preempt=False,
        adaptive=False,
        degrade=False,
        **fields,
    )


def fifo_config(**overrides: Any) -> SchedulerConfig:
    """Arrival order, running decodes never preempted, largest buckets, no timeouts.

    The only protection is a bound on the queue (rejecting when full), as a plain
    continuous-batching server without priorities would have.
    """
    base = _baseline("fifo", Ordering.FIFO, queue={t: QueuePolicy(max_queue_size=4096) for t in Tier})
    return replace(base, **overrides)


def static_priority_config(**overrides: Any) -> SchedulerConfig:
    """Triton-dynamic-batcher-like: priority level = tier, FIFO within a level.

    Same per-tier queue policies (max queue size, REJECT/DELAY timeouts) as ours; no
    modality priority, no deadlines, no aging, no preemption of running decodes, fixed
    (largest) batch, no degradation ladder.
    """
    return replace(_baseline("static_priority", Ordering.STATIC_TIER), **overrides)


def ours_tier_local_config(**overrides: Any) -> SchedulerConfig:
    """Ours, but an end of turn only ranks first within its own tier (gold work, then silver...)."""
    base = ours_config(name="ours_tier_local", policy=PolicyConfig(global_turn_ends=False))
    return replace(base, **overrides)


PRESETS = {
    "ours": ours_config,
    "ours_tier_local": ours_tier_local_config,
    "fifo": fifo_config,
    "static_priority": static_priority_config,
}
