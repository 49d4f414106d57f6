"""How long one link of a chain of dependent kernels costs on this GPU (the floor under a
batch-1 decode step made of many small kernels).

SmolLM2-135M's batch-1 decode graph is 154 kernels in 0.43 ms on an H200 (~2.8 µs each,
bench/results/llm_gpu_s7b.json), against a 0.35 ms target: either a link can get cheaper or the
step needs fewer links. This times chains of `--length` tiny kernels in one CUDA graph, each
reading the previous kernel's output (a row of `--width` floats per program) and writing its own,
with and without Programmatic Dependent Launch, at several grid sizes, plus a chain of
independent kernels (no data dependency, no PDL) for the bare launch cost in a graph. The last
output is checked against the expected value (each link adds 1).

    python3 bench/pdl_chain.py [--length 150] [--grids 1,9,132,384] [--name pdl_chain]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import cuda_graph_ms, write_results  # noqa: E402


@triton.jit
def _link_kernel(x_ptr, y_ptr, W: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, W)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # every program reads the whole previous row (as a GEMV program reads its input vector)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + pid * W + offs, x + 1.0)


def chain(bufs: list[torch.Tensor], grid: int, width: int, pdl: bool) -> None:
    """Link i reads row 0 of bufs[i % 2] and writes bufs[(i + 1) % 2] (grid rows)."""
    for i in range(len(bufs) - 1):
        _link_kernel[(grid,)](bufs[i], bufs[i + 1], W=width, USE_PDL=pdl, num_warps=4,
                              **({"launch_pdl": True} if pdl else {}))


def measure(length: int, grid: int, width: int, pdl: bool) -> dict[str, Any]:
    bufs = [torch.zeros(grid, width, device="cuda") for _ in range(length + 1)]
    chain(bufs, grid, width, pdl)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain(bufs, grid, width, pdl)
    bufs[0].zero_()
    g.replay()
    torch.cuda.synchronize()
    ok = bool(torch.all(bufs[-1] == float(length)))
    ms = cuda_graph_ms(g)
    return {"ms": ms, "us_per_link": ms * 1e3 / length, "correct": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=150)
    ap.add_argument("--grids", default="1,9,132,384")
    ap.add_argument("--width", type=int, default=1024, help="floats each program reads and writes")
    ap.add_argument("--name", default="pdl_chain")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/pdl_chain.py needs a CUDA GPU")
    pdl_ok = torch.cuda.get_device_capability()[0] >= 9
    res: dict[str, Any] = {"length": args.length, "width": args.width, "grids": {}}
    for grid in (int(x) for x in args.grids.split(",")):
        row = {"plain": measure(args.length, grid, args.width, False)}
        if pdl_ok:
            row["pdl"] = measure(args.length, grid, args.width, True)
        res["grids"][grid] = row
        print(f"grid {grid:4d}: " + "  ".join(f"{k} {v['us_per_link']:.2f} us/link (ok={v['correct']})"
                                              for k, v in row.items()), flush=True)
    path = write_results(args.name, res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
