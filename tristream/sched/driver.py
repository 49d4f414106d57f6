"""The loop that feeds trace events to a scheduler and runs its plans on a backend.

One loop for both worlds: with `VirtualClock` + `SimulatedEngine` it is the deterministic
simulator; with `WallClock` + the real-engine backend it drives the GPU. Events are
applied at step boundaries (the engine is never interrupted mid-step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tristream.sched.backend import EngineBackend
from tristream.sched.clock import Clock
from tristream.sched.scheduler import Scheduler, ServedTurn
from tristream.sched.trace import EventKind, TraceEvent
from tristream.sched.types import SessionRefused, UnknownSession, WorkModality


@dataclass(slots=True)
class RunResult:
    """What a run produced."""

    turns: list[ServedTurn]
    steps: int
    busy_ns: int
    end_ns: int
    refused_sessions: int
    digest: str
    plan_sizes: list[int] = field(default_factory=list)


def apply_event(sched: Scheduler, ev: TraceEvent, refused: set[int]) -> None:
    """Deliver one trace event; refused sessions' later events are ignored."""
    if ev.session_id in refused:
        return
    try:
        if ev.kind is EventKind.OPEN:
            sched.open_session(ev.session_id, ev.tier, ev.t_ns, ev.camera_fps)
        elif ev.kind is EventKind.CLOSE:
            sched.close_session(ev.session_id, ev.t_ns)
        elif ev.kind is EventKind.SPEECH_START:
            sched.speech_start(ev.session_id, ev.t_ns)
        elif ev.kind is EventKind.TURN_END:
            sched.turn_end(ev.session_id, ev.t_ns, ev.tokens, ev.answer, WorkModality.SPEECH)
        elif ev.kind is EventKind.TEXT:
            sched.text_message(ev.session_id, ev.t_ns, ev.tokens, ev.answer)
    except SessionRefused:
        refused.add(ev.session_id)
    except UnknownSession:
        refused.add(ev.session_id)


def run(sched: Scheduler, backend: EngineBackend, clock: Clock, events: list[TraceEvent],
        until_ns: int, keep_plan_sizes: bool = False,
        on_step: Callable[[int], None] | None = None) -> RunResult:
    """Drive `sched` over `events` until `until_ns` on `clock`.

    `on_step(now_ns)`, when given, is called after each plan and after each completed step
    (e.g. to watch shed verdicts as they happen).
    """
    refused: set[int] = set()
    i, n, steps, busy = 0, len(events), 0, 0
    sizes: list[int] = []
    while True:
        now = clock.now_ns()
        if now >= until_ns:
            break
        while i < n and events[i].t_ns <= now:
            ev = events[i]
            if ev.kind is EventKind.CLOSE:
                backend.release(ev.session_id)
            apply_event(sched, ev, refused)
            i += 1
        plan = sched.plan(now)
        if on_step is not None:
            on_step(now)
        if plan.empty:
            nxt = min(events[i].t_ns if i < n else math.inf, sched.next_timer_ns() or math.inf, until_ns)
            clock.advance_to(int(max(nxt, now + 1)))
            continue
        res = backend.execute(plan, now)
        clock.advance_to(now + res.duration_ns)
        sched.complete(plan, res, clock.now_ns())
        if on_step is not None:
            on_step(clock.now_ns())
        steps += 1
        busy += res.duration_ns
        if keep_plan_sizes:
            sizes.append(len(plan.entries))
    return RunResult(sched.turns, steps, busy, clock.now_ns(), len(refused), sched.schedule_digest(), sizes)
