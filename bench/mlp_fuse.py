"""The batch-1 decode MLP as one kernel (`kernels/decode_mlp.py`) against the two-kernel pair
of `decode_fused.decode_logits_b1` (norm+gate|up GEMV, then SiLU+down+residual GEMV), per model
shape and kernel configuration (GPU only, random bf16 weights).

The one-kernel MLP replaces a kernel boundary by float32 atomics (programs × hidden of them
per call); `bench/decode_profile.py` found it slower inside the decode graph at 16 rows per
program. This times each configuration alone, PDL-chained 40 times in a CUDA graph (µs per
MLP), with its relative error against the pair, to see whether fewer, larger programs (fewer
atomics) or the transposed down weight pay.

    python3 bench/mlp_fuse.py [--models smollm2-135m,llama-3.2-1b] [--name mlp_fuse]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench._common import write_results  # noqa: E402
from bench.gemv import graph_us  # noqa: E402

SHAPES = {"smollm2-135m": (576, 1536), "llama-3.2-1b": (2048, 8192), "llama-3-8b": (4096, 14336)}


def bench_shape(h: int, inter: int, reps: int = 40) -> dict[str, Any]:
    from tristream.engine.kernels.decode_mlp import fused_mlp1
    from tristream.engine.kernels.gemv import fused_gemv

    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    gu = (torch.randn(2 * inter, h, generator=g, device="cuda") / h ** 0.5).to(dt)
    down = (torch.randn(h, inter, generator=g, device="cuda") / inter ** 0.5).to(dt)
    down_t = down.t().contiguous()
    nw = (1 + 0.1 * torch.randn(h, generator=g, device="cuda")).to(dt)
    x = torch.randn(1, h, generator=g, device="cuda")
    eps = 1e-5

    def pair() -> torch.Tensor:
        a = fused_gemv(x, gu, norm_weight=nw, eps=eps, pdl=True)
        return fused_gemv(a, down, residual=x, silu=True, pdl=True, out_dtype=torch.float32)

    ref = pair()
    out: dict[str, Any] = {"hidden": h, "intermediate": inter,
                           "weights_MB": (3 * h * inter * 2) / 1e6, "pair_us": graph_us(pair, reps, 3)}
    for rows in (16, 32, 64, 128):
        for tr in (False, True):
            for warps in (4, 8):
                name = f"r{rows}{'t' if tr else ''}w{warps}"
                acc = torch.empty(1, h, dtype=torch.float32, device="cuda")

                def one(rows: int = rows, tr: bool = tr, warps: int = warps, acc: torch.Tensor = acc) -> None:
                    acc.copy_(x)
                    fused_mlp1(x, gu, nw, eps, down_t if tr else down, acc, down_t=tr, rows=rows, pdl=True,
                               num_warps=warps)

                def fused_only(rows: int = rows, tr: bool = tr, warps: int = warps, acc: torch.Tensor = acc) -> None:
                    fused_mlp1(x, gu, nw, eps, down_t if tr else down, acc, down_t=tr, rows=rows, pdl=True,
                               num_warps=warps)

                try:
                    one()
                    err = float((acc - ref).norm() / ref.norm())
                    out[name] = {"us": graph_us(fused_only, reps, 3), "rel_err_vs_pair": err}
                except Exception as exc:  # a configuration that does not compile (registers) is reported
                    out[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    ok = {k: v["us"] for k, v in out.items() if isinstance(v, dict) and "us" in v}
    out["best"] = min(ok, key=lambda k: ok[k]) if ok else None
    out["best_vs_pair"] = out["pair_us"] / ok[out["best"]] if ok else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--name", default="mlp_fuse")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/mlp_fuse.py needs a CUDA GPU")
    res: dict[str, Any] = {"models": {}}
    for m in args.models.split(","):
        h, inter = SHAPES[m]
        r = res["models"][m] = bench_shape(h, inter)
        print(m, f"pair {r['pair_us']:.2f} us", " ".join(
            f"{k}={v['us']:.2f}" if "us" in v else f"{k}=ERR" for k, v in r.items() if isinstance(v, dict)),
            f"best {r['best']} x{r['best_vs_pair']:.2f}", flush=True)
        write_results(args.name, res)


if __name__ == "__main__":
    main()
