"""Cross-session scheduler: what runs in the next engine step, for every session at once.

Pieces: `policy` (tier / modality classes, EDF, aging with a proven bound, watermark
weights), `batcher` (captured buckets, token budget, chunked prefill), `controller`
(per-tier AIMD on the step budget), `admission` (Triton-like queue policies, degradation
ladder, shed ledger), `scheduler` (sessions → work items → plans), `sim` + `trace` +
`steptime` (deterministic simulator with a fitted step-time model) and `real` (the same
scheduler driving `tristream.engine.LLMEngine`). `bench/sched.py` compares it with FIFO and
a Triton-like static-priority batcher.
"""

from __future__ import annotations

from tristream.sched.backend import EngineBackend, StepResult
from tristream.sched.clock import VirtualClock, WallClock
from tristream.sched.config import (
    PRESETS,
    SchedulerConfig,
    fifo_config,
    ours_config,
    static_priority_config,
)
from tristream.sched.scheduler import Scheduler, ServedTurn
from tristream.sched.types import Kind, SessionRefused, Tier, WorkItem, WorkModality

__all__ = [
    "PRESETS",
    "EngineBackend",
    "Kind",
    "WorkModality",
    "Scheduler",
    "SchedulerConfig",
    "SessionRefused",
    "StepResult",
    "Tier",
    "ServedTurn",
    "VirtualClock",
    "WallClock",
    "WorkItem",
    "fifo_config",
    "ours_config",
    "static_priority_config",
]
