"""Scheduler benchmark on the deterministic simulator (and, with --real, on the GPU engine).

Simulator: N concurrent tri-modal sessions (speech turns with streaming ASR, a 30 fps camera
sampled for the vision encoder, typed messages, churn) against the fitted H200 step-time
model. Capacity is the largest N that FIFO keeps up with (its backlog stays bounded); loads
0.5×..2× capacity are then run with ours, FIFO and a Triton-like static-priority batcher,
same trace and same engine model for all three. Reported per tier: SLO attainment (turns
answered within the tier's P99 target; shed turns count as misses) and response latency
(end of turn → first token) P50/P99 over served turns.

    .venv/bin/python bench/sched.py                 # simulator → bench/results/sched_sim.json
    .venv/bin/python bench/sched.py --fit           # refit the step-time model → bench/data/sched_steptime_fit.json
    python bench/sched.py --real --sessions 64      # GPU: see bench/real_backend.py
    python bench/sched.py --real --device cpu --model tiny-random --sessions 8 --duration 3   # CPU smoke

--real also prints and records a per-step breakdown (`phases`: scheduler, backend, ASR, vision,
engine host work, decode, prefill, sampling, final sync; host ms and GPU-event ms per phase).
Where the tree has no .git (the device copy), set TRISTREAM_GIT_COMMIT=<sha> so the results
header names the commit; a digest of the tristream/ and bench/ sources is recorded either way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import write_results  # noqa: E402
from tristream.sched.config import PRESETS  # noqa: E402
from tristream.sched.metrics import percentile, summarize  # noqa: E402
from tristream.sched.sim import simulate  # noqa: E402
from tristream.sched.steptime import StepTimeModel, fit_step_time, read_samples_csv  # noqa: E402
from tristream.sched.trace import TraceConfig  # noqa: E402
from tristream.sched.types import Tier  # noqa: E402

DATA = ROOT / "bench" / "data"
SCHEDULERS = ("ours", "ours_tier_local", "static_priority", "fifo")


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def run_one(args: tuple[str, int, float, int, float]) -> dict[str, Any]:
    """One simulation; returns a JSON-ready summary."""
    name, sessions, duration, seed, warmup = args
    cfg = PRESETS[name]()
    t0 = time.perf_counter()
    sched, res = simulate(cfg, TraceConfig(sessions=sessions, duration_s=duration, seed=seed))
    since = int(warmup * 1e9)
    tiers = summarize(res.turns, since)
    served = [r.latency_ms for r in res.turns if r.turn_end_ns >= since and math.isfinite(r.latency_ms)]
    shed: dict[str, int] = {}
    for (reason, _t, _k), n in sched.ledger.shed.items():
        shed[reason.value] = shed.get(reason.value, 0) + n
    service = {}
    for t in Tier:
        tn = t.name.lower()
        dt = sched.stats[f"{tn}/decode_tokens"]
        service[tn] = {
            "decode_tokens": dt,
            "decode_late_fraction": sched.stats[f"{tn}/decode_late"] / dt if dt else math.nan,
            "frames_encoded": sched.stats[f"{tn}/frames_encoded"],
            "frame_encode_p99_ms": percentile(sched.vision_latency_ms[t], 99),
        }
    return {
        "scheduler": name,
        "service": service,
        "sessions": sessions,
        "tiers": {t.name.lower(): s.to_dict() for t, s in tiers.items()},
        "all_served_p50_ms": percentile(served, 50),
        "all_served_p99_ms": percentile(served, 99),
        "shed_by_reason": shed,
        "shed_detail": sched.ledger.to_dict(),
        "events": dict(sched.ledger.events),
        "refused_sessions": res.refused_sessions,
        "final_level": int(sched.level),
        "level_transitions_s": [(round(t / 1e9, 3), int(lv)) for t, lv in sched.ladder.transitions],
        "backlog_at_end": len(sched.items),
        "steps": res.steps,
        "busy_fraction": res.busy_ns / max(1, res.end_ns),
        "schedule_digest": res.digest,
        "sim_wall_s": time.perf_counter() - t0,
    }


def keeps_up(sessions: int, duration: float, seed: int) -> bool:
    """FIFO keeps up if every tier's turns are answered within the loosest target (P99 <= 500 ms)."""
    r = run_one(("fifo", sessions, duration, seed, 4.0))
    p99 = r["all_served_p99_ms"]
    return bool(p99 == p99 and p99 <= 500.0 and not r["shed_by_reason"])


def find_capacity(duration: float, seed: int, lo: int = 50, hi: int = 1600, step: int = 25) -> int:
    """Largest session count (multiple of `step`) that FIFO keeps up with."""
    if not keeps_up(lo, duration, seed):
        raise RuntimeError(f"FIFO cannot keep up even with {lo} sessions; lower --cap-lo")
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if keeps_up(mid, duration, seed):
            lo = mid
        else:
            hi = mid
    return lo


def refit() -> dict[str, Any]:
    """Fit the step-time model to bench/data/sched_steptime.csv (+ engine results if present)."""
    rows = read_samples_csv((DATA / "sched_steptime.csv").read_text())
    sources = ["bench/data/sched_steptime.csv"]
    m = fit_step_time(rows, source="fit to " + " + ".join(sources))
    out = {"model": m.to_dict(), "rows": len(rows), "measured_rows": sum("measured" in r.source for r in rows),
           "residuals_ms": [round(r.ms - m.step_ms(r.decode, r.prefill_tokens, r.images, r.asr_units), 4)
                            for r in rows]}
    (DATA / "sched_steptime_fit.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def simulate_all(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    cap = args.capacity or find_capacity(args.cap_duration, args.seed)
    print(f"capacity (largest N that FIFO serves at P99 <= 500 ms): {cap} sessions  [{time.perf_counter() - t0:.1f}s]")
    loads = [float(x) for x in args.loads.split(",")]
    jobs = [(name, max(1, round(f * cap)), args.duration, args.seed, args.warmup) for f in loads for name in SCHEDULERS]
    with ProcessPoolExecutor(max_workers=args.jobs) as ex:
        results = list(ex.map(run_one, jobs))
    for r, (_, _, _, _, _), f in zip(results, jobs, [f for f in loads for _ in SCHEDULERS], strict=True):
        r["load_x_capacity"] = f
    hdr = f"{'load':>5} {'sched':>16} | " + " | ".join(f"{t:^23}" for t in ("gold ≤50", "silver ≤150", "bronze ≤500"))
    print(hdr + " | shed  refused lvl")
    print(f"{'':>5} {'':>16} | " + " | ".join(f"{'att':>5} {'p50':>7} {'p99':>8}" for _ in range(3)))
    for r in results:
        cells = []
        for t in ("gold", "silver", "bronze"):
            s = r["tiers"][t]
            cells.append(f"{s['attainment']:5.2f} {s['p50_ms']:7.1f} {s['p99_ms']:8.1f}")
        print(f"{r['load_x_capacity']:4.2f}x {r['scheduler']:>16} | " + " | ".join(cells)
              + f" | {sum(r['shed_by_reason'].values()):5d} {r['refused_sessions']:7d} {r['final_level']:3d}")
    print("\nanswer pace (share of decode tokens after their 50 ms/token pace deadline) and frame encode P99 (ms)")
    print(f"{'load':>5} {'sched':>16} | {'late g':>6} {'late s':>6} {'late b':>6} | {'vis g':>6} {'vis s':>6} {'vis b':>6}")
    for r in results:
        sv = r["service"]
        print(f"{r['load_x_capacity']:4.2f}x {r['scheduler']:>16} | "
              + " ".join(f"{sv[t]['decode_late_fraction']:6.2f}" for t in ("gold", "silver", "bronze")) + " | "
              + " ".join(f"{sv[t]['frame_encode_p99_ms']:6.0f}" for t in ("gold", "silver", "bronze")))
    top = [r for r in results if r["load_x_capacity"] == max(loads) and r["scheduler"] == "ours"][0]
    check = {
        "load_x_capacity": max(loads),
        "gold_p99_ms": top["tiers"]["gold"]["p99_ms"],
        "gold_shed": top["tiers"]["gold"]["shed"],
        "gold_p99_within_target": top["tiers"]["gold"]["p99_ms"] <= 50.0 and top["tiers"]["gold"]["shed"] == 0,
        "bronze_shed_items": sum(n for k, n in top["shed_detail"].items() if "/bronze/" in k),
        "bronze_turns_shed": top["tiers"]["bronze"]["shed"],
    }
    print("at the highest load, ours:", check)
    model = StepTimeModel()
    out = {
        "what": "scheduler simulator: ours vs Triton-like static priority vs FIFO, loads relative to capacity",
        "command": "python bench/sched.py " + " ".join(sys.argv[1:]),
        "capacity_sessions": cap,
        "capacity_rule": "largest N (multiple of 25) at which FIFO answers all turns with P99 <= 500 ms, nothing shed",
        "trace": {k: getattr(TraceConfig(), k) for k in TraceConfig.__slots__ if k != "sessions"}
        | {"duration_s": args.duration, "seed": args.seed, "warmup_s": args.warmup},
        "tiers_ms": {t.name.lower(): s.p99_target_ms for t, s in PRESETS["ours"]().tiers.items()},
        "step_time_model": model.to_dict(),
        "overload_check": check,
        "runs": results,
        "bench_wall_s": time.perf_counter() - t0,
    }
    path = write_results("sched_sim", _clean(out))
    print(f"wrote {path}")


def source_digest() -> str:
    """sha256 over tristream/**/*.py and bench/*.py (path + content): identifies the code without .git."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted([*ROOT.glob("tristream/**/*.py"), *ROOT.glob("bench/*.py")]):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def print_phases(name: str, ph: dict[str, Any]) -> None:
    """One line per phase: mean host / GPU ms per step and share of wall time."""
    print(f"  {name} per-step breakdown (mean host ms | mean GPU-event ms | P99 host ms | share of wall):")
    for k, v in sorted(ph.items(), key=lambda kv: -kv[1]["share_of_wall"]):
        print(f"    {k:>8}: {v['host_ms_mean']:8.3f} | {v['gpu_ms_mean']:8.3f} | {v['host_ms_p99']:8.2f} | "
              f"{100 * v['share_of_wall']:5.1f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=20.0, help="simulated seconds per run")
    p.add_argument("--warmup", type=float, default=4.0, help="turns ending before this are not counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loads", default="0.5,0.75,1.0,1.25,1.5,2.0")
    p.add_argument("--capacity", type=int, default=0, help="skip the search and use this many sessions as 1x")
    p.add_argument("--cap-duration", type=float, default=20.0, help="simulated seconds of each capacity probe")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--fit", action="store_true", help="refit the step-time model and exit")
    p.add_argument("--real", action="store_true", help="drive the real GPU engine (see bench/real_backend.py)")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--model", default="", help="--real: HF folder / GGUF, or a preset (llama-3.2-1b, tiny-random)")
    p.add_argument("--device", default="cuda", help="--real: cuda or cpu")
    p.add_argument("--real-schedulers", default="ours,fifo,static_priority")
    p.add_argument("--no-encoders", action="store_true", help="--real: LLM only (no SigLIP / Whisper steps)")
    args = p.parse_args()
    if args.fit:
        print(json.dumps(refit(), indent=2))
        return
    if args.real:
        from bench.sched_real import bench_real

        res = bench_real(sessions=args.sessions, duration_s=args.duration, seed=args.seed, model=args.model,
                         warmup_s=args.warmup, device=args.device, encoders=not args.no_encoders,
                         schedulers=tuple(args.real_schedulers.split(",")))
        res["command"] = "python bench/sched.py " + " ".join(sys.argv[1:])
        res["source_digest"] = source_digest()
        res["git_commit_env"] = os.environ.get("TRISTREAM_GIT_COMMIT")
        for name, r in res["runs"].items():
            print(f"{name:>16}: response P50 {r['response_p50_ms']:.1f} ms  P99 {r['response_p99_ms']:.1f} ms  "
                  f"(sim predicted {r['simulator_prediction']['response_p50_ms']:.1f} / "
                  f"{r['simulator_prediction']['response_p99_ms']:.1f})  turns {r['turns_served']}  "
                  f"steps {r['steps']}  step P50 {r['step_ms_p50']:.2f} ms  {r['consistency']}")
            print_phases(name, r["phases"])
        print("device fit:", json.dumps(_clean({k: v for k, v in res["device_fit"].items()}), indent=1))
        path = write_results("sched_real" if args.device.startswith("cuda") else "sched_real_cpu_smoke", _clean(res))
        if args.device.startswith("cuda"):
            rows = ["# measured by bench/sched.py --real (one row per engine step): decode,prefill,images,asr,ms",
                    "decode,prefill_tokens,images,asr_units,ms"]
            for r in res["runs"].values():
                rows += [",".join(str(v) for v in smp) for smp in r["samples"]]
            (DATA / "sched_steptime_h200_steps.csv").write_text("\n".join(rows) + "\n")
        print(f"wrote {path}")
        return
    simulate_all(args)


if __name__ == "__main__":
    main()
