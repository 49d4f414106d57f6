"""Batch-1 GEMV on the GPU: our Triton kernel in several tiles against cuBLAS, per projection shape.

Why: the decode graphs' capture timings (`bench/results/llm_gpu.json`) show the batch-1 fused
path 2-4x slower than the cuBLAS path (1B: 3.90 vs 1.03 ms per step), so the GEMV itself must
be fixed before fusing more around it pays. This times every projection of SmolLM2-135M,
Llama-3.2-1B and Llama-3-8B (qkv, o, gate|up, down, head) in bf16:

* cuBLAS: ``F.linear`` of one row (what the cuBLAS decode path runs);
* ours: `fused_gemv` (plain, no prologue or epilogue) for each tile (rows x K columns) and
  warp count in `TILES`, plus the default tile, each checked against cuBLAS first.

Each variant is timed as a CUDA graph of `--reps` back-to-back calls (launch cost inside a
graph, as in decode), over several rounds; the table gives microseconds per call, achieved
GB/s of weight bytes, and that as a share of the copy bandwidth measured in the same run.

    python bench/gemv.py [--models smollm2-135m,llama-3.2-1b] [--reps 50] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import capture_graph, write_results  # noqa: E402

TILES: list[tuple[int | None, int | None, int]] = [
    (None, None, 4), (64, 128, 4), (32, 256, 4), (16, 512, 4), (128, 64, 4), (64, 128, 8), (32, 256, 8), (8, 1024, 8),
]
"""(rows, K columns, warps) per program; None: the kernel's default for the shape."""


def shapes(preset_name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each decode projection of a preset."""
    from tristream.engine.config import preset

    c = preset(preset_name)
    hd = c.head_dim
    return {"qkv": ((c.num_heads + 2 * c.num_kv_heads) * hd, c.hidden_size), "o": (c.hidden_size, c.num_heads * hd),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
            "head": (c.vocab_size, c.hidden_size)}


def graph_us(fn: Any, reps: int, rounds: int) -> float:
    """Median microseconds per call of `fn` replayed `reps` times inside one CUDA graph."""
    import torch

    g = capture_graph(fn, warm=3, calls=reps)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b,llama-3-8b")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="gemv_gpu")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise SystemExit("bench/gemv.py times GPU kernels: run it on a CUDA machine (see bench/gpu_round.sh)")
    from bench.llm import copy_bandwidth
    from tristream.engine.kernels.gemv import fused_gemv

    bw = copy_bandwidth() / 2  # read bandwidth: a GEMV reads its weight once
    print(f"copy bandwidth (read share) {bw / 1e12:.2f} TB/s")
    out: dict[str, Any] = {"read_bandwidth_TBps": bw / 1e12, "reps": args.reps, "rounds": args.rounds, "models": {}}
    for model in args.models.split(","):
        rows: dict[str, Any] = {}
        for proj, (n, k) in shapes(model).items():
            g = torch.Generator(device="cuda").manual_seed(n + k)
            w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
            x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
            ref = F.linear(x, w)
            nbytes = w.numel() * w.element_size()
            row: dict[str, Any] = {"N": n, "K": k, "MB": nbytes / 1e6}
            t = graph_us(lambda x=x, w=w: F.linear(x, w), args.reps, args.rounds)
            row["cublas_us"] = t
            row["cublas_bw_share"] = nbytes / (t * 1e-6) / bw
            best = ("cublas", t)
            for bn, bk, nw in TILES:
                label = f"{bn or 'def'}x{bk or 'def'}w{nw}"
                try:
                    got = fused_gemv(x, w, block_n=bn, block_k=bk, num_warps=nw)
                    err = float((got.float() - ref.float()).norm() / ref.float().norm())
                    if not err < 2e-2:
                        raise ValueError(f"differs from cuBLAS: rel err {err:.3g}")
                    t = graph_us(lambda x=x, w=w, bn=bn, bk=bk, nw=nw: fused_gemv(x, w, block_n=bn, block_k=bk,
                                                                                  num_warps=nw),
                                 args.reps, args.rounds)
                except Exception as exc:  # a tile that does not compile or fit is reported, not fatal
                    row[label] = f"{type(exc).__name__}: {exc}"[:200]
                    continue
                row[label] = {"us": t, "bw_share": nbytes / (t * 1e-6) / bw}
                if t < best[1]:
                    best = (label, t)
            row["best"] = best[0]
            rows[proj] = row
            ours = {lab: v["us"] for lab, v in row.items() if isinstance(v, dict)}
            fastest = min(ours, key=lambda lab: ours[lab]) if ours else None
            print(f"{model:14s} {proj:8s} N={n:6d} K={k:5d} {nbytes / 1e6:7.1f} MB  cuBLAS {row['cublas_us']:7.1f} us "
                  f"({row['cublas_bw_share']:.0%})  ours best {fastest} "
                  f"{ours.get(fastest, float('nan')) if fastest else float('nan'):7.1f} us  overall best {best[0]}")
        out["models"][model] = rows
    path = write_results(args.name, out, extra_modules=("triton",))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
