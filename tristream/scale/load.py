"""What an engine replica reports about its load, and how the router compares replicas.

The signal is the scheduler's own (`tristream.sched`), not CPU %: a replica keeps one
`TierControllers` (the per-tier sliding-window response-latency P99 the scheduler's AIMD
controllers use) over the turns it served, and counts its queued work (answers in flight
plus client messages not yet processed). When the replica's backend factory drives a
`tristream.sched.Scheduler` (attribute ``scheduler``), its ``backlog_pressure()`` and
per-tier ``pressure()`` are folded in. ``pressure`` > 1 means the replica misses its target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tristream.sched.controller import AIMDConfig, TierControllers
from tristream.sched.types import Tier, TierSpec


@dataclass(slots=True)
class LoadReport:
    """One replica's load at one instant (plain data: it crosses process boundaries)."""

    replica: str
    sessions: int
    queue_depth: int
    p99_ms: float | None
    target_p99_ms: float
    target_queue_depth: float
    sched_pressure: float | None = None
    accepting: bool = True
    extra: dict[str, float] = field(default_factory=dict)
    held: list[str] | None = None
    """Session ids the replica holds (the router drops pins of sessions it no longer has)."""

    @property
    def pressure(self) -> float:
        """max(queue depth / target, P99 / target, scheduler pressure); > 1 = over target."""
        parts = [self.queue_depth / self.target_queue_depth if self.target_queue_depth > 0 else 0.0]
        if self.p99_ms is not None and self.target_p99_ms > 0:
            parts.append(self.p99_ms / self.target_p99_ms)
        if self.sched_pressure is not None:
            parts.append(self.sched_pressure)
        return max(parts)

    @property
    def latency_pressure(self) -> float:
        """max(P99 / target, scheduler pressure): how far the replica is from its latency target,
        without the queue term (answers in flight grow with the sessions a replica holds, so
        placing by them herds a burst of new sessions onto whichever replica reported fewer)."""
        parts = [0.0]
        if self.p99_ms is not None and self.target_p99_ms > 0:
            parts.append(self.p99_ms / self.target_p99_ms)
        if self.sched_pressure is not None:
            parts.append(self.sched_pressure)
        return max(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (pressure included)."""
        d = asdict(self)
        d.pop("held")
        d["pressure"] = self.pressure
        return d


def least_loaded(reports: Sequence[LoadReport], sessions: dict[str, int] | None = None,
                 headroom: float = 1.0) -> LoadReport | None:
    """The accepting replica that is least loaded by the scheduler's signal.

    Replicas whose latency pressure (`LoadReport.latency_pressure`: windowed P99 and scheduler
    pressure against target) is under ``headroom`` — meeting their target — count as equally
    loaded and the fewest sessions wins: ``sessions`` overrides the reports' counts with the
    router's own, which include opens still in flight, so a burst of opens alternates between
    equal replicas even on one cached round of reports. Above it, the lowest pressure (in
    steps of 0.1) wins, so a replica that misses its target gets new sessions only when every
    replica does. Then queue depth, then the name, so the choice is deterministic.

    (The first version banded by `LoadReport.pressure`, queue included, from 0.5: on two H200s
    that sent 279 of 384 sessions to one replica, since answers in flight — the queue — follow
    the sessions held and the P99 window still held the previous load:
    ``bench/results/scale_gpu_x2.json``.)
    """
    counts = sessions or {}
    cands = [r for r in reports if r.accepting]
    if not cands:
        return None

    def band(r: LoadReport) -> float:
        p = r.latency_pressure
        return 0.0 if p < headroom else round(p, 1)

    return min(cands, key=lambda r: (band(r), counts.get(r.replica, r.sessions), r.queue_depth, r.replica))


class LoadTracker:
    """A replica's response-latency window and queue counter (see the module docstring)."""

    def __init__(self, target_p99_ms: float = 50.0, target_queue_depth: float = 8.0,
                 horizon_ms: float = 10_000.0, min_samples: int = 5) -> None:
        self.target_p99_ms = target_p99_ms
        self.target_queue_depth = target_queue_depth
        tiers = {Tier.GOLD: TierSpec(Tier.GOLD, target_p99_ms)}
        self.windows = TierControllers(tiers, AIMDConfig(min_samples=min_samples), horizon_ms=horizon_ms)
        self.turns = 0

    def record_turn(self, now_ns: int, latency_ms: float | None) -> None:
        """One finished answer: end of turn → first text (None = no text: counted as a miss)."""
        self.turns += 1
        self.windows.record(Tier.GOLD, now_ns, math.inf if latency_ms is None else latency_ms)

    def report(self, replica: str, now_ns: int, sessions: int, queue_depth: int, accepting: bool = True,
               scheduler: Any | None = None) -> LoadReport:
        """Snapshot for the router and the autoscaler."""
        sched_p: float | None = None
        if scheduler is not None:
            vals = [scheduler.backlog_pressure()]
            vals += [p for t in Tier if (p := scheduler.pressure(t, now_ns)) is not None]
            sched_p = max(vals)
        p99 = self.windows.p99(Tier.GOLD, now_ns)
        return LoadReport(replica, sessions, queue_depth, None if p99 is None else float(p99),
                          self.target_p99_ms, self.target_queue_depth, sched_p, accepting,
                          {"turns": float(self.turns)})
