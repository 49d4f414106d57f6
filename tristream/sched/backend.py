"""The small contract between the scheduler and whatever executes a step.

The scheduler decides *what* runs (a `BatchPlan`); a backend decides *how* and reports
how long it took. `SimulatedEngine` (sim.py) models the time; `tristream.sched.real`
wraps the GPU engine. A `Clock` gives the scheduler its notion of now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tristream.sched.batcher import BatchPlan


@dataclass(slots=True)
class StepResult:
    """Outcome of one executed step."""

    duration_ns: int
    finished_sessions: set[int] = field(default_factory=set)
    """Sessions whose answer hit end-of-sequence in this step (answer ends early)."""
    tokens: dict[int, int] = field(default_factory=dict)
    """item_id -> sampled token id, where the backend produces real tokens."""


@runtime_checkable
class EngineBackend(Protocol):
    """Executes one planned step."""

    def execute(self, plan: BatchPlan, now_ns: int) -> StepResult:
        """Run `plan` starting at `now_ns`; return its duration and outcomes."""
        ...

    def release(self, session_id: int) -> None:
        """Forget a session (free its KV cache)."""
        ...


class Clock(Protocol):
    """Source of time for the driving loop."""

    def now_ns(self) -> int:
        """Current time."""
        ...

    def advance_to(self, t_ns: int) -> None:
        """Wait (or jump, for a virtual clock) until `t_ns`."""
        ...


class VirtualClock:
    """Deterministic clock that only moves when told to."""

    def __init__(self, start_ns: int = 0) -> None:
        self._now = start_ns

    def now_ns(self) -> int:
        """Current virtual time."""
        return self._now

    def advance_to(self, t_ns: int) -> None:
        """Jump forward (never back)."""
        if t_ns > self._now:
            self._now = t_ns


class WallClock:
    """`perf_counter_ns` clock for the real engine; waiting sleeps."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter_ns()

    def now_ns(self) -> int:
        """Nanoseconds since construction."""
        return time.perf_counter_ns() - self._t0

    def advance_to(self, t_ns: int) -> None:
        """Sleep until `t_ns` (used only when the scheduler is idle)."""
        dt = t_ns - self.now_ns()
        if dt > 0:
            time.sleep(dt / 1e9)
