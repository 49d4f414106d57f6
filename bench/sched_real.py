"""`bench/sched.py --real`: each scheduler over the same seeded trace on the real engine
(`bench/real_backend.RealEngineBackend`), its response latencies and per-step phases, and a
refit of the step-time model to the measured steps."""

from __future__ import annotations

import math
import time
from typing import Any

from bench.phases import summarize_phases
from bench.real_backend import RealEngineBackend, build_encoders, time_scheduler
from tristream.sched.backend import WallClock
from tristream.sched.real import build_engine


def _summary(sched: Any, res: Any, backend: RealEngineBackend, warmup_s: float) -> dict[str, Any]:
    from tristream.sched.metrics import percentile, summarize

    since = int(warmup_s * 1e9)
    served = [r.latency_ms for r in res.turns if r.turn_end_ns >= since and math.isfinite(r.latency_ms)]
    st = backend.stats
    ms = [s[4] for s in st.samples]
    return {
        "tiers": {t.name.lower(): s.to_dict() for t, s in summarize(res.turns, since).items()},
        "response_p50_ms": percentile(served, 50),
        "response_p99_ms": percentile(served, 99),
        "turns_served": len(served),
        "shed": sched.ledger.to_dict(),
        "steps": res.steps,
        "step_ms_p50": percentile(ms, 50),
        "step_ms_p99": percentile(ms, 99),
        "busy_fraction": res.busy_ns / max(1, res.end_ns),
        "consistency": {"first_tokens": st.first_tokens, "decode_tokens": st.decode_tokens,
                        "missing_first_token": st.missing_first_token, "unplanned_tokens": st.unplanned_tokens,
                        "cancelled": st.cancelled},
        "phases": summarize_phases(st.phases, ms),  # one entry per step (profile=True)
        "prefill_step_phases": summarize_phases([ph for ph, smp in zip(st.phases, st.samples, strict=False) if smp[1]],
                                                [smp[4] for smp in st.samples if smp[1]]),
        "samples": [list(s) for s in st.samples],
    }


def fit_from_samples(samples: list[tuple[int, int, int, int, float]]) -> dict[str, Any]:
    """Refit the step-time model to measured single-component steps; check it on mixed ones."""
    from tristream.sched.metrics import percentile
    from tristream.sched.steptime import StepSample, fit_step_time

    rows: list[StepSample] = []
    mixed: list[tuple[int, int, int, int, float]] = []
    for d, p, i, a, ms in samples:
        if i == 0 and a == 0 and (d or p):
            rows.append(StepSample("llm", d, p, 0, 0, ms, "measured"))
        elif i and not (d or p or a):
            rows.append(StepSample("vision", 0, 0, i, 0, ms, "measured"))
        elif a and not (d or p or i):
            rows.append(StepSample("asr", 0, 0, 0, a, ms, "measured"))
        else:
            mixed.append((d, p, i, a, ms))
    out: dict[str, Any] = {"pure_rows": len(rows), "mixed_rows": len(mixed)}
    try:
        m = fit_step_time(rows, "measured on the device by bench/sched.py --real", nonneg=True)
    except ValueError as e:  # not enough single-component steps of some kind
        out["error"] = str(e)
        return out
    out["model"] = m.to_dict()
    err = [abs(m.step_ms(d, p, i, a) - ms) / ms for d, p, i, a, ms in mixed if ms > 0]
    out["mixed_rel_error_p50"] = percentile(err, 50)
    out["mixed_rel_error_p99"] = percentile(err, 99)
    return out


def bench_real(sessions: int = 64, duration_s: float = 20.0, seed: int = 0, model: str = "",
               warmup_s: float = 4.0, device: str = "cuda", schedulers: tuple[str, ...] = ("ours", "fifo"),
               encoders: bool = True, kv_bytes: int | None = None) -> dict[str, Any]:
    """Run each scheduler over the same seeded trace on the real engine, one after the other."""
    import torch

    from tristream.sched.config import PRESETS
    from tristream.sched.driver import run
    from tristream.sched.scheduler import Scheduler
    from tristream.sched.sim import simulate
    from tristream.sched.steptime import CalibratedStepTime, StepTimeModel
    from tristream.sched.trace import TraceConfig, generate_trace

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    eng = build_engine(model, device, kv_bytes or ((8 << 30) if device.startswith("cuda") else (64 << 20)))
    enc = build_encoders(device, tiny=model == "tiny-random") if encoders else None
    load_s = time.perf_counter() - t0
    trace = TraceConfig(sessions=sessions, duration_s=duration_s, seed=seed)
    out: dict[str, Any] = {"sessions": sessions, "duration_s": duration_s, "seed": seed,
                           "model": model or "llama-3.2-1b (random weights)", "device": device,
                           "encoders": ("graphed SigLIP-B/16 (VisionGraphBank) + Whisper-tiny streaming updates "
                                        "(WhisperRunner: 10 s window, 8 tokens), random weights") if encoders else None,
                           "load_s": load_s, "runs": {}}
    warm = RealEngineBackend(eng, enc, seed=seed)  # warm-up: kernels, allocator, graphs
    for _ in range(3):
        s = Scheduler(PRESETS["ours"]())
        run(s, warm, WallClock(), generate_trace(TraceConfig(sessions=8, duration_s=1.0, seed=seed + 99)), int(1e9))
    for sid in list(warm.seq_of):
        warm.release(sid)
    for name in schedulers:
        backend = RealEngineBackend(eng, enc, seed=seed)
        model_est = CalibratedStepTime(StepTimeModel())
        sched = Scheduler(PRESETS[name](), model_est)
        time_scheduler(sched, backend)
        res = run(sched, backend, WallClock(), generate_trace(trace), int(duration_s * 1e9))
        for sid in list(backend.seq_of):
            backend.release(sid)
        eng.step()
        out["runs"][name] = _summary(sched, res, backend, warmup_s)
        out["runs"][name]["measured_over_model_ratio"] = model_est.ratio
        _, sim = simulate(PRESETS[name](), trace)
        from tristream.sched.metrics import percentile

        lat = [r.latency_ms for r in sim.turns if r.turn_end_ns >= warmup_s * 1e9 and math.isfinite(r.latency_ms)]
        out["runs"][name]["simulator_prediction"] = {"response_p50_ms": percentile(lat, 50),
                                                     "response_p99_ms": percentile(lat, 99)}
    allsamples = [(int(x[0]), int(x[1]), int(x[2]), int(x[3]), float(x[4])) for r in out["runs"].values()
                  for x in r["samples"]]
    out["device_fit"] = fit_from_samples(allsamples)
    return out
