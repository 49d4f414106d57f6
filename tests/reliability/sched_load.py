"""Scheduler-level overload harness (issue 9, items 1-2), shared by the tests and `bench/reliability.py`.

`capacity_sessions` finds how many sessions our scheduler carries on the simulated engine
with every tier at target and nothing shed; `overload_run` drives our scheduler at a
multiple of that on the virtual clock with the same loop as `tristream.sched.driver.run`,
but notes the virtual time at which every shed turn got its verdict, so the time from the
moment a turn became unservable (queue full at arrival, or its timeout expired) to its
rejection is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tristream.sched.admission import ShedReason
from tristream.sched.clock import VirtualClock
from tristream.sched.config import ours_config
from tristream.sched.driver import run
from tristream.sched.metrics import TierSummary, summarize
from tristream.sched.scheduler import Scheduler
from tristream.sched.session import WorkShape
from tristream.sched.sim import SimulatedEngine
from tristream.sched.steptime import StepTimeModel
from tristream.sched.trace import TraceConfig, generate_trace
from tristream.sched.types import MS, Kind, Tier

HEAVY = WorkShape(asr_interval_ms=40.0, vision_fps=8.0, vision_tokens_per_frame=32)
WARMUP_NS = 2_000_000_000


def capacity_sessions(lo: int = 40, hi: int = 800, step: int = 40, duration_s: float = 10.0) -> int:
    """Largest multiple of `step` in [lo, hi] that our scheduler serves with nothing shed at all.

    (Every tier at target and an empty shed ledger: no frame dropped, no answer shortened.)
    """
    best = 0
    n = lo
    while n <= hi:
        r = overload_run(n, duration_s)
        if r.ledger or any(s.p99_ms > s.target_ms for s in r.summary.values() if s.served):
            break
        best = n
        n += step
    if best == 0:
        raise AssertionError(f"even {lo} sessions shed work: the simulated engine is misconfigured")
    return best


@dataclass(slots=True)
class OverloadResult:
    """What an overload run showed."""

    sessions: int
    duration_s: float
    summary: dict[Tier, TierSummary]
    shed_delays_ms: dict[str, list[float]] = field(default_factory=dict)
    late_served: int = 0
    """Turns whose first token came after their tier's TURN_END timeout (must be 0)."""
    served_after_deadline_ms: list[float] = field(default_factory=list)
    unanswered: int = 0
    """Turns that ended neither with a first token nor with a shed reason (must be 0)."""
    ledger: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    refused_sessions: int = 0
    """Sessions refused at open (degradation level 4): answered at once with `SessionRefused`."""


def overload_run(sessions: int, duration_s: float, seed: int = 3) -> OverloadResult:
    """Our scheduler at `sessions` on the virtual clock; see the module docstring."""
    cfg = ours_config(shape=HEAVY)
    model = StepTimeModel()
    sched = Scheduler(cfg, model)
    engine = SimulatedEngine(model, seed=seed + 1)
    clock = VirtualClock()
    trace = TraceConfig(sessions=sessions, duration_s=duration_s, seed=seed)
    events = generate_trace(trace)
    until = int(duration_s * 1e9)
    delays: dict[str, list[float]] = {r.value: [] for r in (ShedReason.QUEUE_FULL, ShedReason.TIMEOUT)}
    seen = 0

    def verdicts(now: int) -> None:
        nonlocal seen
        for rec in sched.turns[seen:]:
            if rec.shed is None:
                continue
            due = rec.turn_end_ns
            if rec.shed is ShedReason.TIMEOUT:
                due += int(cfg.queue[rec.tier].timeouts_ms.get(Kind.TURN_END, 0.0) * MS)
            delays.setdefault(rec.shed.value, []).append(max(0, now - due) / MS)
        seen = len(sched.turns)

    res = run(sched, engine, clock, events, until, on_step=verdicts)
    out = OverloadResult(sessions, duration_s, summarize(sched.turns, since_ns=WARMUP_NS), delays, steps=res.steps)
    for rec in sched.turns:
        timeout = cfg.queue[rec.tier].timeouts_ms.get(Kind.TURN_END)
        if math.isfinite(rec.latency_ms):
            if timeout is not None and rec.latency_ms > timeout:
                out.late_served += 1
                out.served_after_deadline_ms.append(rec.latency_ms - timeout)
        elif rec.shed is None:
            out.unanswered += 1
    out.ledger = sched.ledger.to_dict()
    out.refused_sessions = res.refused_sessions
    return out
