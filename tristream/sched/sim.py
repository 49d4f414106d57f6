"""Deterministic simulator: virtual clock + an engine whose step time is modelled.

`simulate(config, trace_config)` generates the seeded trace, runs the scheduler against
`SimulatedEngine` on a `VirtualClock`, and returns the run; the same seed gives the same
schedule (`RunResult.digest`).
"""

from __future__ import annotations

import random

from tristream.sched.backend import StepResult
from tristream.sched.batcher import BatchPlan
from tristream.sched.clock import VirtualClock
from tristream.sched.config import SchedulerConfig
from tristream.sched.driver import RunResult, run
from tristream.sched.scheduler import Scheduler
from tristream.sched.steptime import StepTimeModel
from tristream.sched.trace import TraceConfig, generate_trace
from tristream.sched.types import MS


class SimulatedEngine:
    """EngineBackend whose step takes `model.step_ms(plan)` times seeded log-normal jitter."""

    def __init__(self, model: StepTimeModel | None = None, seed: int = 0, jitter: float = 0.05) -> None:
        self.model = model or StepTimeModel()
        self._rng = random.Random(seed)
        self.jitter = jitter
        self.released: list[int] = []

    def execute(self, plan: BatchPlan, now_ns: int) -> StepResult:
        """Model the step's duration (no tokens are produced)."""
        ms = self.model.step_ms(plan.decode, plan.prefill_tokens, plan.images, plan.asr_units)
        if self.jitter > 0:
            ms *= self._rng.lognormvariate(0.0, self.jitter)
        return StepResult(duration_ns=max(1, int(ms * MS)))

    def release(self, session_id: int) -> None:
        """Nothing to free in a model; remembered for tests."""
        self.released.append(session_id)


def simulate(config: SchedulerConfig, trace: TraceConfig, model: StepTimeModel | None = None,
             jitter: float = 0.05) -> tuple[Scheduler, RunResult]:
    """Run one seeded simulation of `config` under `trace`."""
    m = model or StepTimeModel()
    sched = Scheduler(config, m)
    engine = SimulatedEngine(m, seed=trace.seed + 1, jitter=jitter)
    events = generate_trace(trace)
    res = run(sched, engine, VirtualClock(), events, int(trace.duration_s * 1e9))
    return sched, res
