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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench._common import write_results  # noqa: E402


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
    write_results(args.name, {"model": args.model, "before": t, "after": t2, "profile": text.splitlines()[:60]})


if __name__ == "__main__":
    main()
