"""The small contract between the scheduler and whatever executes a step.

The scheduler decides *what* runs (a `BatchPlan`); a backend decides *how* and reports
how long it took. `SimulatedEngine` (sim.py) models the time; `turn_executor.TurnExecutor`
runs the plans on the real engine. A `tristream.sched.clock.Clock` gives the scheduler its notion of now.
"""

from __future__ import annotations

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


# the clocks moved to `tristream.sched.clock`; this import path keeps working for older callers
from tristream.sched.clock import VirtualClock, WallClock  # noqa: E402

__all__ = ["EngineBackend", "StepResult", "VirtualClock", "WallClock"]
