"""Batch-1 fused decode over e4m3 weights: `decode_fused.decode_logits_b1` with `fp8_gemv`'s kernels.

* `fp8_qkv_rope_store1`: `decode_fused.qkv_rope_store1` for e4m3 weights and row scales.
* `decode_logits_b1_fp8`: the 5-kernel layer (norm+QKV+RoPE+store, attention, O+residual,
  norm+gate|up, SiLU+down+residual); each projection runs the kernel and tile `fp8_tune` chose
  for its shape, else the variant's GEMV tile.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tristream.engine.kernels.decode_fused import _pdl_launch, pair_rows, proj_tile, rope_store_pair
from tristream.engine.kernels.fp8_gemv import TUNED, fp8_gemv1, fp8_mm
from tristream.engine.kernels.gemv import norm_x, row_rstd
from tristream.engine.kernels.pdl import pdl_mode, pdl_start, pdl_wait
from tristream.engine.kernels.triton_ops import paged_decode_attention, rms_norm


@triton.jit
def _fp8_qkv_rope_store1_kernel(x_ptr, w_ptr, s_ptr, b_ptr, nw_ptr, pos_ptr, cs_ptr, slot_ptr, q_out_ptr,
                                kc_ptr, vc_ptr, K, eps, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                                HALF: tl.constexpr, PAIR: tl.constexpr, NORM: tl.constexpr,
                                HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                                LATE_NORM: tl.constexpr):
    """`decode_fused._qkv_rope_store1_kernel` for e4m3 weights and row scales."""
    pdl_start(USE_PDL)
    h = tl.program_id(0)
    j = tl.program_id(1)
    r1 = h * HD + j * PAIR + tl.arange(0, PAIR)
    r2 = r1 + HALF
    dt = x_ptr.dtype.element_ty
    rk0 = tl.arange(0, BLOCK_K)
    k0mask = rk0 < K
    w1 = tl.load(w_ptr + r1[:, None] * K + rk0[None, :], mask=k0mask[None, :], other=0.0)
    w2 = tl.load(w_ptr + r2[:, None] * K + rk0[None, :], mask=k0mask[None, :], other=0.0)
    s1 = tl.load(s_ptr + r1)
    s2 = tl.load(s_ptr + r2)
    pdl_wait(USE_PDL)
    rstd = 1.0
    if NORM and not LATE_NORM:
        rstd = row_rstd(x_ptr, K, eps, BLOCK_K)
    xv = tl.load(x_ptr + rk0, mask=k0mask, other=0.0)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    if NORM:
        xv, ss = norm_x(xv, tl.load(nw_ptr + rk0, mask=k0mask, other=0.0), rstd, ss, dt, LATE_NORM)
    acc1 = tl.sum(w1.to(tl.float32) * xv.to(tl.float32)[None, :], 1)
    acc2 = tl.sum(w2.to(tl.float32) * xv.to(tl.float32)[None, :], 1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        xv = tl.load(x_ptr + rk, mask=kmask, other=0.0)
        if NORM:
            xv, ss = norm_x(xv, tl.load(nw_ptr + rk, mask=kmask, other=0.0), rstd, ss, dt, LATE_NORM)
        w1 = tl.load(w_ptr + r1[:, None] * K + rk[None, :], mask=kmask[None, :], other=0.0)
        w2 = tl.load(w_ptr + r2[:, None] * K + rk[None, :], mask=kmask[None, :], other=0.0)
        acc1 += tl.sum(w1.to(tl.float32) * xv.to(tl.float32)[None, :], 1)
        acc2 += tl.sum(w2.to(tl.float32) * xv.to(tl.float32)[None, :], 1)
    acc1 = acc1 * s1
    acc2 = acc2 * s2
    if NORM and LATE_NORM:
        rs = tl.rsqrt(tl.sum(ss, 0) / K + eps)
        acc1 = acc1 * rs
        acc2 = acc2 * rs
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + r1).to(tl.float32)
        acc2 += tl.load(b_ptr + r2).to(tl.float32)
    x1 = acc1.to(dt).to(tl.float32)
    x2 = acc2.to(dt).to(tl.float32)
    d1 = j * PAIR + tl.arange(0, PAIR)
    rope_store_pair(h, d1, x1, x2, pos_ptr, cs_ptr, slot_ptr, q_out_ptr, kc_ptr, vc_ptr, NH, NKV, HD, HALF)


def fp8_qkv_rope_store1(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                        norm_weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                        cos_sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        nh: int, nkv: int, hd: int, pdl: bool | int = False, tile: tuple[int, int] | None = None,
                        num_warps: int = 4, late_norm: bool = False) -> torch.Tensor:
    """`decode_fused.qkv_rope_store1` for e4m3 codes `w` and row scales `scale`; q [1, nh, hd]."""
    if x.shape[0] != 1:
        raise ValueError(f"fp8_qkv_rope_store1 is the batch-1 kernel; got {x.shape[0]} rows")
    n, k = w.shape
    if n != (nh + 2 * nkv) * hd or hd % 2:
        raise ValueError(f"weight rows {n} != (heads {nh} + 2 x kv heads {nkv}) x head_dim {hd} (even)")
    half = hd // 2
    pair = pair_rows(half, k, None if tile is None else tile[0])
    block_k = min(triton.next_power_of_2(k), 1024) if tile is None else tile[1]
    q = torch.empty(1, nh, hd, dtype=x.dtype, device=w.device)
    dummy = q
    _fp8_qkv_rope_store1_kernel[(nh + 2 * nkv, half // pair)](
        x, w, scale, bias if bias is not None else dummy, norm_weight if norm_weight is not None else dummy,
        positions, cos_sin, slots, q, k_cache, v_cache, k, eps,
        NH=nh, NKV=nkv, HD=hd, HALF=half, PAIR=pair, NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        BLOCK_K=block_k, USE_PDL=pdl_mode(pdl), LATE_NORM=late_norm, num_warps=num_warps, **_pdl_launch(pdl),
    )
    return q


def _blocks(tile: tuple[int, int] | None, k: int) -> tuple[int | None, int | None]:
    t = proj_tile(tile, k)
    return t if t is not None else (None, None)


def decode_logits_b1_fp8(model: Any, h: torch.Tensor, attention: Any, pdl: bool | int = False,
                         tile: tuple[int, int] | None = None, num_warps: int = 4, head_cublas: bool = False,
                         late_norm: bool = False, raw_logits: bool = False) -> torch.Tensor:
    """`decode_fused.decode_logits_b1` for a model whose projections hold e4m3 weights
    (`Linear.set_fp8`); the same options. `head_cublas`: the final norm as its own kernel and the
    head through `Linear` (an fp8 head: `fp8_gemv1`; a dense one: cuBLAS)."""
    cfg = model.cfg
    l0 = model.layers[0]
    bn, bk = _blocks(tile, l0.qkv.in_features)
    on, ok = _blocks(tile, l0.o.in_features)
    dn, dk = _blocks(tile, l0.down.in_features)
    t_qkv = None if bn is None or bk is None else (bn, bk)
    eps = cfg.rms_norm_eps
    r = h
    for i, layer in enumerate(model.layers):
        kc, vc = attention.cache.flat(i)
        qkv, o, gu_w, down = layer.qkv.qtensors, layer.o.qtensors, layer.gate_up.qtensors, layer.down.qtensors
        q = fp8_qkv_rope_store1(r, qkv["w"], qkv["s"], layer.qkv.bias, layer.input_norm, eps, attention.positions,
                                model.cos_sin, attention.slots, kc, vc, cfg.num_heads, cfg.num_kv_heads,
                                cfg.head_dim, pdl=pdl, tile=t_qkv, num_warps=num_warps, late_norm=late_norm)
        a = paged_decode_attention(q, kc, vc, attention.block_tables, attention.ctx_lens, attention.cache.block_size,
                                   attention.scale, attention.splits, pdl=pdl,
                                   counters=getattr(attention, "counters", None)).view(1, cfg.q_size)
        r = _proj1(a, o, (on, ok, num_warps), pdl, residual=r)
        gu = _proj1(r, gu_w, (bn, bk, num_warps), pdl, norm_weight=layer.post_norm, eps=eps, late_norm=late_norm)
        r = _proj1(gu, down, (dn, dk, num_warps), pdl, residual=r, silu=True)
    head = model.head()
    if head_cublas or head.qformat != "fp8":
        x = rms_norm(r, model.norm, eps, out_dtype=model.norm.dtype)
        return head(x) if raw_logits else model.logits(x)
    return _proj1(r, head.qtensors, (bn, bk, num_warps), pdl, norm_weight=model.norm, eps=eps,
                  out_dtype=torch.float32, late_norm=late_norm)


def _proj1(x: torch.Tensor, t: dict[str, torch.Tensor], tile: tuple[int | None, int | None, int], pdl: bool | int,
           **kw: Any) -> torch.Tensor:
    """One batch-1 projection of the fused decode: the kernel and tile `tune_model` timed fastest
    for this shape (the tensor-core kernel runs the one-pass norm as the two-pass one), else the
    GEMV in the variant's tile."""
    n, k = t["w"].shape
    cfg = TUNED.get((1, n, k))
    if cfg is not None and cfg[0] == "mm":
        kw.pop("late_norm", None)
        out_dtype = kw.pop("out_dtype", None)
        y = fp8_mm(x, t["w"], t["s"], config=cfg, pdl=pdl, **kw)
        return y if out_dtype is None else y.to(out_dtype)
    if cfg is not None and cfg[0] == "gemv":  # the tile timed fastest for this shape
        return fp8_gemv1(x, t["w"], t["s"], block_n=cfg[1], block_k=cfg[2], num_warps=cfg[3],
                         unroll=cfg[4] if len(cfg) > 4 else 1, pdl=pdl, **kw)
    return fp8_gemv1(x, t["w"], t["s"], block_n=tile[0], block_k=tile[1], num_warps=tile[2], pdl=pdl, **kw)
