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

from tristream.sched.controller import AIMDConfig, LatencyWindow, TierControllers
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
    window_sessions: float | None = None
    """Mean sessions the replica held when the turns of its P99 window finished (None: no turns)."""

    @property
    def pressure(self) -> float:
        """max(queue depth / target, P99 / target, scheduler pressure); > 1 = over target."""
        queue = self.queue_depth / self.target_queue_depth if self.target_queue_depth > 0 else 0.0
        return max(queue, self.latency_pressure)

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

    Each replica's load is its sessions (``sessions``: the router's own counts, opens still in
    flight included, override the reports' counts) plus one, weighted by the square of its
    latency pressure (`LoadReport.latency_pressure`: windowed P99 and scheduler pressure against
    target) where that is over ``headroom``: replicas meeting their target are balanced by
    sessions, a burst of opens alternates between them even on one cached round of reports, and
    a replica at 1.5x its target draws new sessions at 1 / 2.25 of the rate of one on target.
    Ties: the shorter queue, then the name, so the choice is deterministic.

    The latency pressure is scaled by ``min(1, (sessions + 1) / (window_sessions + 1))``: a P99
    measured while the replica held 270 sessions says little about it once it holds 20, and the
    window lags by its horizon (10 s). A weight, not a band: a hard threshold on a lagging signal
    herds whole bursts of opens onto one replica (docs/scale.md, "Alternatives measured").
    """
    counts = sessions or {}
    cands = [r for r in reports if r.accepting]
    if not cands:
        return None

    def load(r: LoadReport) -> float:
        n = counts.get(r.replica, r.sessions)
        p = r.latency_pressure
        if r.window_sessions is not None:
            p *= min(1.0, (n + 1) / (r.window_sessions + 1))
        weight = p * p if p >= headroom else 1.0
        return round((n + 1) * weight, 6)

    return min(cands, key=lambda r: (load(r), r.queue_depth, r.replica))


class LoadTracker:
    """A replica's response-latency window and queue counter (see the module docstring)."""

    def __init__(self, target_p99_ms: float = 50.0, target_queue_depth: float = 8.0,
                 horizon_ms: float = 10_000.0, min_samples: int = 5) -> None:
        self.target_p99_ms = target_p99_ms
        self.target_queue_depth = target_queue_depth
        tiers = {Tier.GOLD: TierSpec(Tier.GOLD, target_p99_ms)}
        self.windows = TierControllers(tiers, AIMDConfig(min_samples=min_samples), horizon_ms=horizon_ms)
        self.turns = 0
        self.held = LatencyWindow(horizon_ms)  # sessions held at each turn of the latency window

    def record_turn(self, now_ns: int, latency_ms: float | None, sessions: int | None = None) -> None:
        """One finished answer: end of turn → first text (None = no text: counted as a miss);
        ``sessions``: how many the replica held then (`LoadReport.window_sessions`)."""
        self.turns += 1
        self.windows.record(Tier.GOLD, now_ns, math.inf if latency_ms is None else latency_ms)
        if sessions is not None:
            self.held.add(now_ns, sessions)

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
                          {"turns": float(self.turns)}, window_sessions=self.held.mean(now_ns))
