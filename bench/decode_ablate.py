"""What each kind of kernel costs inside the PDL-chained batch-1 decode graph (GPU only).

The profiler's per-kernel durations overlap under PDL (a kernel's time includes its wait for the
one before), so they do not say what removing or speeding up one kind would save. This captures
the batch-1 step (`decode_fused.decode_logits_b1`'s kernels, in the graph's chosen tile) with one
kind of kernel left out at a time — attention, the O projection, the MLP pair, the output head —
and with the attention split count forced to 1…16, and reports each graph's replay time and the
difference to the full step: the marginal cost of that kind in the chain.

The ablated graphs compute nonsense (a skipped kernel's output is the stale buffer); only their
time is used. The full graph's logits are checked against the engine's own eager variant.

    python3 bench/decode_ablate.py [--model smollm2-135m] [--variant b8_pdl_hc] [--ctx 128,512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench._common import cuda_graph_ms, write_results  # noqa: E402


def step(model: Any, h: torch.Tensor, attn: Any, tile: Any, warps: int, hc: bool, skip: set[str],
         splits: int | None, short_ctx: int | None = None, attn_warps: int = 4) -> torch.Tensor:
    """`decode_logits_b1` with PDL and kinds of kernels left out (`skip`: attention, o, mlp, head, qkv)."""
    from tristream.engine.kernels.decode_fused import proj_blocks, qkv_rope_store1
    from tristream.engine.kernels.gemv import fused_gemv
    from tristream.engine.kernels.triton_ops import paged_decode_attention, rms_norm

    cfg = model.cfg
    (bn, bk), (on, ok), (dn, dk) = proj_blocks(model, tile)
    t_qkv = None if bn is None or bk is None else (bn, bk)
    eps = cfg.rms_norm_eps
    r = h
    q = torch.zeros(1, cfg.num_heads, cfg.head_dim, dtype=h.dtype, device=h.device)
    for i, layer in enumerate(model.layers):
        kc, vc = attn.cache.flat(i)
        if "qkv" not in skip:
            q = qkv_rope_store1(r, layer.qkv.weight, layer.qkv.bias, layer.input_norm, eps, attn.positions,
                                model.cos_sin, attn.slots, kc, vc, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                pdl=True, tile=t_qkv, num_warps=warps)
        a = q.view(1, cfg.q_size)
        if "attention" not in skip:
            a = paged_decode_attention(q, kc, vc, attn.block_tables, attn.ctx_lens, attn.cache.block_size,
                                       attn.scale, splits or attn.splits, pdl=True,
                                       counters=attn.counters if (splits or attn.splits) > 1 else None,
                                       short_ctx=short_ctx, num_warps=attn_warps).view(1, cfg.q_size)
        if "o" not in skip:
            r = fused_gemv(a, layer.o.weight, residual=r, pdl=True, block_n=on, block_k=ok, num_warps=warps)
        if "mlp" not in skip:
            gu = fused_gemv(r, layer.gate_up.weight, norm_weight=layer.post_norm, eps=eps, pdl=True, block_n=bn,
                            block_k=bk, num_warps=warps)
            r = fused_gemv(gu, layer.down.weight, residual=r, silu=True, pdl=True, block_n=dn, block_k=dk,
                           num_warps=warps)
    if "head" in skip:
        return r.float()
    if hc:
        return model.logits(rms_norm(r, model.norm, eps, out_dtype=model.norm.dtype))
    return fused_gemv(r, model.head().weight, norm_weight=model.norm, eps=eps, pdl=True, block_n=bn,
                      block_k=bk, num_warps=warps, out_dtype=torch.float32)


def graph_ms(fn: Any) -> tuple[float, torch.Tensor]:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    ms = cuda_graph_ms(g, warm=5, reps=200)
    g.replay()
    torch.cuda.synchronize()
    res = out.clone()
    del g
    return ms, res


def measure(m: Any, h: torch.Tensor, attn: Any, tile: Any, warps: int, hc: bool, ref: torch.Tensor) -> dict[str, Any]:
    """Full step, each kind left out, each split count: replay ms (and the full step's agreement)."""
    row: dict[str, Any] = {}
    full_ms, got = graph_ms(lambda: step(m, h, attn, tile, warps, hc, set(), None))
    row["full_ms"] = round(full_ms, 4)
    row["full_equals_engine_variant"] = bool(torch.equal(got, ref))
    row["full_rel_err_vs_engine"] = float((got - ref).norm() / ref.norm())
    for skip in ("attention", "o", "mlp", "head", "qkv", "attention+o"):
        ms, _ = graph_ms(lambda s=skip: step(m, h, attn, tile, warps, hc, set(s.split("+")), None))
        row[f"without_{skip}_ms"] = round(ms, 4)
        row[f"cost_{skip}_us_per_step"] = round((full_ms - ms) * 1e3, 1)
    for short, aw in ((0, 4), (0, 8), (128, 4), (256, 4), (256, 8), (512, 8)):
        ms, out = graph_ms(lambda s=short, w=aw: step(m, h, attn, tile, warps, hc, set(), None, s, w))
        row[f"short_ctx{short}_warps{aw}_ms"] = round(ms, 4)
        row[f"short_ctx{short}_warps{aw}_rel_err"] = float((out - ref).norm() / ref.norm())
    for sp in (1, 2, 4, 8, 16):
        ms, out = graph_ms(lambda s=sp: step(m, h, attn, tile, warps, hc, set(), s))
        row[f"splits{sp}_ms"] = round(ms, 4)
        row[f"splits{sp}_rel_err"] = float((out - ref).norm() / ref.norm())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--variant", default="b8_pdl_hc")
    ap.add_argument("--ctx", default="128,512", help="prompt lengths (the context of the measured step)")
    ap.add_argument("--name", default="decode_ablate")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_ablate.py needs a CUDA GPU")
    from decode_profile import _engine
    from llm import random_model

    from tristream.engine.graphs import TritonDecodeAttention, b1_options
    from tristream.engine.kernels import triton_ops as K
    from tristream.engine.sequence import SamplingParams

    model = random_model(args.model)
    eng = _engine(model)
    dec = eng.runner.decoder
    opts = b1_options(args.variant)
    pdl, hc, tile, warps = opts["pdl"], opts["head_cublas"], opts["tile"], opts["num_warps"]
    if not pdl or opts["mlp"] is not None or opts["attn_o"]:
        raise SystemExit("--variant: a PDL variant without the one-kernel MLP or attention+O kernel "
                         "(e.g. b8_pdl_hc, b1_pdl, bw_pdl)")
    res: dict[str, Any] = {"model": args.model, "variant": args.variant, "ctx": {}}
    with torch.inference_mode():
        for ctx in (int(c) for c in args.ctx.split(",")):
            for sid in list(eng.seqs):
                eng.cancel(sid)
            eng.step()
            gen = torch.Generator().manual_seed(ctx)
            eng.add_request(torch.randint(10, model.cfg.vocab_size, (ctx,), generator=gen).tolist(),
                            SamplingParams(max_tokens=64, ignore_eos=True))
            while any(not s.is_decode for s in eng.seqs.values()) or not eng.seqs:
                eng.step()
            for _ in range(4):
                eng.step()
            torch.cuda.synchronize()
            m = dec.model
            splits = K.choose_splits(1, m.cfg.num_heads, dec.num_sms)
            attn = TritonDecodeAttention(m, dec.cache, dec.positions[:1], dec.slots[:1], dec.block_tables[:1],
                                         dec.ctx_lens[:1], splits, dec.merge_counters)
            h = m.embed(dec.ids[:1])
            ref = dec.forward(1, args.variant).clone()
            row = measure(m, h, attn, tile, warps, hc, ref)
            row["default_splits"] = splits
            res["ctx"][str(ctx)] = row
            print(ctx, row, flush=True)
    path = write_results(args.name, res)
    print("wrote", path)


if __name__ == "__main__":
    main()
