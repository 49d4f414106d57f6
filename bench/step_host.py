"""Where the host's time goes in overlapped batch-1 decode steps (GPU, issue #3).

SmolLM2-135M with random bf16 weights (`bench.llm.random_model`), one sequence decoding after a
128-token prompt, `EngineConfig.overlap` on. Reports the median ms of `step()`, of its wait for the
token read-back and of the rest (the host's own work), then a cProfile of `--steps` steps (the
functions by their own time: Python bookkeeping vs. the CUDA calls: input copy, graph launch,
read-back copy, event record and wait).

    python3 bench/step_host.py [--model smollm2-135m] [--steps 400] [--name step_host]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench._common import hold_engine, write_results  # noqa: E402


def graph_events(eng: Any, steps: int) -> dict[str, float]:
    """CUDA events around every replay of the bucket-1 graph during `steps` overlapped steps: the
    graph's own GPU time in the engine, and the GPU time between two graphs (input copy, read-back
    copy, and any idle time while the host had not yet queued the next step)."""
    dec = eng.runner.decoder
    g = dec.graphs[1]
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    class Timed:
        def replay(self) -> None:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            marks.append((a, b))

    dec.graphs[1] = Timed()
    uploads0 = dec.uploads
    try:
        for _ in range(steps):
            eng.step()
    finally:
        dec.graphs[1] = g
    torch.cuda.synchronize()
    dur = [a.elapsed_time(b) for a, b in marks]
    gaps = [marks[i][1].elapsed_time(marks[i + 1][0]) for i in range(len(marks) - 1)]
    period = [marks[i][0].elapsed_time(marks[i + 1][0]) for i in range(len(marks) - 1)]
    return {"graph_ms": statistics.median(dur), "between_graphs_ms": statistics.median(gaps),
            "gpu_period_ms": statistics.median(period), "between_p90_ms": sorted(gaps)[int(len(gaps) * 0.9)],
            "input_copies_per_step": (dec.uploads - uploads0) / steps}


def between_ops(eng: Any, reps: int = 100) -> dict[str, float]:
    """ms per replay of the bucket-1 graph back to back, and with the ops an overlapped step puts
    between two graphs: the input copy (host to device, the bytes a chained step copies), the token
    read-back (device to host, 8 bytes) with its event, and both."""
    dec = eng.runner.decoder
    g = dec.graphs[1]
    hold_engine(eng)  # the replays below use the last step's inputs as they are
    lo, used = dec.o_flag, dec.o_bt + dec.max_blocks
    src = dec.dev_buf.cpu().pin_memory()  # the current inputs (and HOLD): the copies leave them as they are
    tok = dec.tokens[1]
    dst = torch.zeros(1, dtype=torch.int64).pin_memory()
    ev = torch.cuda.Event()

    def h2d() -> None:
        dec.dev_buf[lo:used].copy_(src[lo:used], non_blocking=True)

    def d2h() -> None:
        dst.copy_(tok, non_blocking=True)
        ev.record()

    out = {}
    for name in ("graph", "graph+h2d", "graph+d2h", "graph+h2d+d2h"):
        for _ in range(5):
            g.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            if "h2d" in name:
                h2d()
            g.replay()
            if "d2h" in name:
                d2h()
        e.record()
        e.synchronize()
        out[name] = s.elapsed_time(e) / reps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--name", default="step_host")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_host.py needs a CUDA GPU")
    from llm import bench_engine, random_model
    from pdl_early import _start, step_times

    model = random_model(args.model)
    eng = bench_engine(model)
    eng.set_overlap(True)
    _start(eng, model.cfg.vocab_size)
    t = step_times(eng, args.steps)
    print(f"step {t['step_ms']:.4f} ms, host busy {t['host_busy_ms']:.4f}, wait {t['wait_ms']:.4f}", flush=True)
    between = between_ops(eng)
    print("between graphs (ms per replay): " + ", ".join(f"{k} {v:.4f}" for k, v in between.items()), flush=True)
    ev = graph_events(eng, args.steps)
    print(f"in the engine: graph {ev['graph_ms']:.4f} ms, between graphs {ev['between_graphs_ms']:.4f} "
          f"(p90 {ev['between_p90_ms']:.4f}), GPU period {ev['gpu_period_ms']:.4f}, "
          f"input copies per step {ev['input_copies_per_step']:.3f}", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        eng.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    text = buf.getvalue()
    print(text, flush=True)
    t2 = step_times(eng, args.steps)
    print(f"after the profile: step {t2['step_ms']:.4f} ms, host busy {t2['host_busy_ms']:.4f}", flush=True)
    write_results(args.name, {"model": args.model, "before": t, "between_ops": between, "events": ev, "after": t2, "profile": text.splitlines()[:60]})


if __name__ == "__main__":
    main()
