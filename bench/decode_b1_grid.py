"""Batch-1 decode step graphs over a grid of kernel options, in one process (GPU only, issue #3).

The options of `kernels/decode_fused.decode_logits_b1` that the named variants of
`engine/graphs.py` fix: PDL mode (1: a kernel lets its successor launch after its wait, 2: at its
start, `kernels/pdl.py`), the one-pass norm (`late_norm`), the GEMV tile (rows, K columns) and
warps, the head through cuBLAS. Per model (random bf16 weights, 128-token prompt, steady decode),
each configuration's graph replay ms (median of rounds, the configurations alternating within
each round) and its logits' relative error against the cuBLAS path.

    python3 bench/decode_b1_grid.py [--models smollm2-135m,llama-3.2-1b] [--rounds 3] [--name decode_b1_grid]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench._common import capture_graph, cuda_graph_ms, write_results  # noqa: E402

DEFAULT_GRID = {
    "smollm2-135m": "b8w_pdl_hc,r4w4_pdle_ln_hc,r4w4q8_pdle_ln_hc,r4w4q16_pdle_ln_hc,r4w4q2_pdle_ln_hc,"
                    "r4w4a2_pdle_ln_hc,r4w4a8_pdle_ln_hc,r4w4a1_pdle_ln_hc,r4w4q8a2_pdle_ln_hc",
    "llama-3.2-1b": "bw_pdl,r4w4_pdl,r4w4_pdle,r4w4_pdl_ln,r2w4_pdl,r2w4_pdle,r4w2_pdl,r4w8_pdl,r4w4_pdl_hc",
}
"""Per model, the configurations of a default run: a named variant of `engine/graphs.py` (b8w_pdl_hc,
bw_pdl), or r{rows}w{warps}[q{qkv rows}][a{attention warps}]_{pdl|pdle}[_ln][_hc]: GEMV tile of `rows`
rows × the whole K (up to 2048 columns), `warps` warps per program, the QKV kernel's rows, the attention
kernel's warps, PDL mode 1 or 2 (e), the one-pass norm, the head through cuBLAS."""

NAMED = {"b8w_pdl_hc": {"pdl": 1, "tile": (0, 2048), "num_warps": 8, "head_cublas": True},
         "bw_pdl": {"pdl": 1, "tile": (8, 2048), "num_warps": 4}}


def parse(cfg: str) -> dict[str, Any]:
    """A configuration name → decode_logits_b1 keyword arguments."""
    if cfg in NAMED:
        return NAMED[cfg]
    m = re.fullmatch(r"r(\d+)w(\d+)(?:q(\d+))?(?:a(\d+))?_(pdle?)(_ln)?(_hc)?", cfg)
    if m is None:
        raise SystemExit(f"bad configuration {cfg!r}: want r<rows>w<warps>[q<qkv rows>][a<attention warps>]"
                         f"_pdl[e][_ln][_hc] or one of {list(NAMED)}")
    kw = {"pdl": 2 if m.group(5) == "pdle" else 1, "tile": (int(m.group(1)), 2048), "num_warps": int(m.group(2)),
          "late_norm": m.group(6) is not None, "head_cublas": m.group(7) is not None}
    if m.group(3):
        kw["qkv_rows"] = int(m.group(3))
    if m.group(4):
        kw["attn_warps"] = int(m.group(4))
    return kw


def _forward(dec: Any, kw: dict[str, Any]) -> torch.Tensor:
    from tristream.engine.graphs import TritonDecodeAttention
    from tristream.engine.kernels import triton_ops as K
    from tristream.engine.kernels.decode_fused import decode_logits_b1

    m = dec.model
    splits = K.choose_splits(1, m.cfg.num_heads, dec.num_sms)
    attn = TritonDecodeAttention(m, dec.cache, dec.positions[:1], dec.slots[:1], dec.block_tables[:1],
                                 dec.ctx_lens[:1], splits, dec.merge_counters)
    return decode_logits_b1(m, m.embed(dec.ids[:1]), attn, **kw)


def run_model(name: str, rounds: int, cfgs: list[str], ctx: int = 128) -> dict[str, Any]:
    from decode_profile import _engine, _steady
    from llm import random_model

    model = random_model(name)
    eng = _engine(model)
    dec = eng.runner.decoder
    out: dict[str, Any] = {}
    with torch.inference_mode():
        _steady(eng, 1, model.cfg.vocab_size, ctx)
        ref = dec.forward(1, "cublas").clone()
        graphs: dict[str, Any] = {}
        for cfg in cfgs:
            kw = parse(cfg)
            try:
                got = _forward(dec, kw).float()
                err = float((got - ref).norm() / ref.norm().clamp(min=1e-30))
                graphs[cfg] = capture_graph(lambda kw=kw: _forward(dec, kw))
                out[cfg] = {"kw": {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()},
                            "rel_err_vs_cublas": err, "greedy_same": bool(got.argmax(-1).eq(ref.argmax(-1)).all()),
                            "ms": []}
            except Exception as exc:  # one broken configuration must not hide the others
                out[cfg] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                print(f"{name} {cfg}: {out[cfg]['error']}", flush=True)
        for _ in range(rounds):
            for cfg, g in graphs.items():
                out[cfg]["ms"].append(cuda_graph_ms(g, warm=5, reps=100))
        base = None
        for cfg in graphs:
            r = out[cfg]
            r["median_ms"] = statistics.median(r["ms"])
            base = base or r["median_ms"]
            print(f"{name} {cfg:<18} {r['median_ms']:.4f} ms  x{base / r['median_ms']:.3f} vs first  "
                  f"err {r['rel_err_vs_cublas']:.2e} same={r['greedy_same']}  rounds {[round(x, 4) for x in r['ms']]}",
                  flush=True)
    del graphs, eng, model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=128, help="prompt tokens (the context of the measured step)")
    ap.add_argument("--name", default="decode_b1_grid")
    ap.add_argument("--grid", default=None, help="model=cfg,cfg;model=... (default DEFAULT_GRID)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_b1_grid.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict[str, Any] = {"ctx": args.ctx, "models": {}}
    grid = dict(DEFAULT_GRID)
    if args.grid:
        grid.update(dict(part.split("=", 1) for part in args.grid.split(";")))
    for name in args.models.split(","):
        res["models"][name] = run_model(name, args.rounds, grid[name].split(","), args.ctx)
        write_results(args.name, res)
    print(f"wrote bench/results/{args.name}.json")


if __name__ == "__main__":
    main()
