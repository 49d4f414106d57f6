"""Per-step time breakdown of `bench/real_backend.py`: where a step's time goes, phase by phase.

The backend (and the engine, through `LLMEngine.timer`) calls `mark(name)` when a phase
starts; `close()` ends the last phase. Each mark records the host clock and, on CUDA, an event
on the current stream. After the step's final synchronisation `phases()` gives, per phase,
the host milliseconds (time the Python thread spent issuing it, including any host sync it
waited on) and the GPU milliseconds between its events (what the stream took, including
gaps where the GPU waited for the host to launch: when GPU ≈ host the phase is launch-bound).
Nothing here synchronises the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class PhaseTimer:
    """Marks of one step; `use_events` records CUDA events too (no sync until `phases`)."""

    use_events: bool = False
    marks: list[tuple[str, int, Any]] = field(default_factory=list)

    def mark(self, name: str) -> None:
        """Phase `name` starts now (and the previous one ends)."""
        ev = None
        if self.use_events:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.marks.append((name, time.perf_counter_ns(), ev))

    def close(self) -> None:
        """End the last phase."""
        self.mark("_end")

    def phases(self) -> dict[str, tuple[float, float]]:
        """{phase: (host_ms, gpu_ms)} summed over the step (gpu_ms is nan without events).

        Call after the device has synchronised (events must be complete)."""
        out: dict[str, tuple[float, float]] = {}
        for (name, t0, e0), (_, t1, e1) in zip(self.marks, self.marks[1:], strict=False):
            host = (t1 - t0) / 1e6
            gpu = e0.elapsed_time(e1) if e0 is not None and e1 is not None else float("nan")
            h, g = out.get(name, (0.0, 0.0))
            out[name] = (h + host, g + gpu)
        return out


def summarize_phases(steps: list[dict[str, tuple[float, float]]], wall_ms: list[float]) -> dict[str, Any]:
    """Mean / P50 / P99 host and GPU ms per phase over steps, and each phase's share of wall time."""
    from tristream.sched.metrics import percentile

    names = sorted({n for s in steps for n in s})
    total = sum(wall_ms) or 1.0
    out: dict[str, Any] = {}
    for n in names:
        host = [s[n][0] if n in s else 0.0 for s in steps]
        gpu = [s[n][1] if n in s else 0.0 for s in steps]
        out[n] = {"host_ms_mean": sum(host) / max(1, len(host)), "host_ms_p50": percentile(host, 50),
                  "host_ms_p99": percentile(host, 99), "gpu_ms_mean": sum(gpu) / max(1, len(gpu)),
                  "gpu_ms_p99": percentile(gpu, 99), "share_of_wall": sum(host) / total}
    return out
