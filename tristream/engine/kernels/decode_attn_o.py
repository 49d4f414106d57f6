"""Batch-1 decode attention with the O projection and the residual add folded in: one kernel
instead of two per layer.

Program (h, j) of the grid (heads, max(column blocks, splits)):

* context ≤ `short` positions (`triton_ops.short_attend`): program (h, j) attends head h over the
  whole context and multiplies the result by the O weights of head h and output columns
  [j·BLOCK_O, (j+1)·BLOCK_O), a tile loaded before the PDL wait. Every column block recomputes
  the (short) attention of its head: the K/V loads come from L2.
* a longer context: program (h, j) is split j of head h (`triton_ops.split_context`); the split
  that merges the head's partials multiplies the merged output by the head's whole O slice.

The products land in an int64 fixed-point row (`gemv.FX_ONE` units) through integer atomics,
with the residual row added by the head-0 programs: integer sums do not depend on their order, so
the result is bitwise reproducible (float atomics are not). The next kernel (norm + gate|up,
`gemv.fused_gemv` with an int64 x) reads it as float32 and stores a float32 copy for the down
projection's residual add. The row must be zero before the kernel: `decode_logits_b1` takes
one zeroed [layers, hidden] buffer per step.

Compared with the unfused pair, the attention output is rounded to the weight dtype before the
product as before, but the O product is not rounded before the residual add, and the residual
sum is kept to 2**-32 instead of in the weight dtype: closer to float32, not bitwise the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tristream.engine.kernels.gemv import FX, FX_ONE
from tristream.engine.kernels.pdl import pdl_mode, pdl_start
from tristream.engine.kernels.triton_ops import short_attend, short_ctx_default, split_context


@triton.jit
def _o_tile(w_ptr, h, n0, HIDDEN, NH: tl.constexpr, HD: tl.constexpr, BLOCK_O: tl.constexpr):
    """O[n0 : n0 + BLOCK_O, h·HD : (h+1)·HD] (rows past HIDDEN: zeros)."""
    rn = n0 + tl.arange(0, BLOCK_O)
    d = tl.arange(0, HD)
    return tl.load(w_ptr + rn[:, None] * (NH * HD) + h * HD + d[None, :], mask=(rn < HIDDEN)[:, None], other=0.0)


@triton.jit
def _o_tile_add(o, w, res_ptr, acc_ptr, h, n0, HIDDEN, BLOCK_O: tl.constexpr):
    """acc[n0 : n0 + BLOCK_O] += w · o (+ the residual for head 0), in fixed point."""
    rn = n0 + tl.arange(0, BLOCK_O)
    nm = rn < HIDDEN
    part = tl.sum(w.to(tl.float32) * o.to(w.dtype).to(tl.float32)[None, :], 1)
    if h == 0:
        part += tl.load(res_ptr + rn, mask=nm, other=0.0).to(tl.float32)
    tl.atomic_add(acc_ptr + rn, (part * FX).to(tl.int64), mask=nm, sem="relaxed")


@triton.jit
def _attn_o_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, w_ptr, res_ptr, acc_ptr, a_ptr, po_ptr, pm_ptr, pl_ptr,
                   cnt_ptr, scale, HIDDEN, NB, NH: tl.constexpr, NKV: tl.constexpr, GROUP: tl.constexpr,
                   HD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                   SHORT: tl.constexpr, BLOCK_O: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    h = tl.program_id(0)
    j = tl.program_id(1)
    ctx = tl.load(ctx_ptr)
    if ctx <= SHORT:
        if j < NB:
            # this program's O tile first (constant weights: before the wait)
            w = _o_tile(w_ptr, h, j * BLOCK_O, HIDDEN, NH, HD, BLOCK_O)
            o = short_attend(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx, 0, h, scale, NH, NKV, GROUP, HD, PAGE, SHORT,
                             USE_PDL)
            _o_tile_add(o, w, res_ptr, acc_ptr, h, j * BLOCK_O, HIDDEN, BLOCK_O)
    else:
        if j < SPLITS:
            wrote = split_context(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, a_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr, 0,
                                  scale, 0, h, j, NH, NKV, GROUP, HD, PAGE, BLOCK_N, SPLITS, USE_PDL, True)
            if wrote == 1:
                tl.debug_barrier()  # the head's output, just stored by this program's threads
                o = tl.load(a_ptr + h * HD + tl.arange(0, HD)).to(tl.float32)
                for n0 in range(0, HIDDEN, BLOCK_O):
                    w = _o_tile(w_ptr, h, n0, HIDDEN, NH, HD, BLOCK_O)
                    _o_tile_add(o, w, res_ptr, acc_ptr, h, n0, HIDDEN, BLOCK_O)


def attn_o_b1(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              ctx_lens: torch.Tensor, page: int, scale: float, splits: int, counters: torch.Tensor,
              o_weight: torch.Tensor, residual: torch.Tensor, acc: torch.Tensor, pdl: bool | int = False,
              short_ctx: int | None = None, block_o: int = 64, num_warps: int = 4) -> torch.Tensor:
    """Batch 1: `acc += residual + O · attention(q)` in fixed point (module doc); returns `acc`.

    q [1, nh, hd]; caches [slots, nkv, hd]; `counters` as `paged_decode_attention` takes them
    (int32 zeros, ≥ nh, kept between calls); `o_weight` [hidden, nh·hd]; `residual` [1, hidden];
    `acc` a zeroed int64 [hidden] row. splits ≥ 2 (the long-context path merges in the kernel);
    short_ctx: longest context done without splits (None: `short_ctx_default(hd)`)."""
    b, nh, hd = q.shape
    hidden = o_weight.shape[0]
    if b != 1:
        raise ValueError(f"attn_o_b1 is the batch-1 kernel; got {b} rows")
    if splits < 2:
        raise ValueError("attn_o_b1 needs splits ≥ 2 (its long-context path merges the splits itself)")
    if o_weight.shape[1] != nh * hd or residual.numel() != hidden:
        raise ValueError(f"o_weight {tuple(o_weight.shape)} / residual {tuple(residual.shape)} do not match "
                         f"{nh} heads of {hd}")
    if acc.dtype != torch.int64 or acc.numel() != hidden or not acc.is_contiguous():
        raise ValueError(f"acc must be a contiguous int64 row of {hidden}")
    if counters.dtype != torch.int32 or counters.numel() < nh:
        raise ValueError(f"counters must be int32 with at least {nh} elements")
    short = short_ctx_default(hd) if short_ctx is None else short_ctx
    if short < 16 or short & (short - 1):
        raise ValueError(f"short_ctx must be a power of two ≥ 16, not {short}")
    a = torch.empty(nh * hd, dtype=q.dtype, device=q.device)  # the long path's merged head outputs
    po = torch.empty(nh * splits, hd, dtype=torch.float32, device=q.device)
    pm = torch.empty(nh * splits, dtype=torch.float32, device=q.device)
    pl = torch.empty(nh * splits, dtype=torch.float32, device=q.device)
    nb = triton.cdiv(hidden, block_o)
    _attn_o_kernel[(nh, max(nb, splits))](
        q, k_cache, v_cache, block_tables, ctx_lens, o_weight, residual, acc, a, po, pm, pl, counters, scale,
        hidden, nb, NH=nh, NKV=k_cache.shape[1], GROUP=nh // k_cache.shape[1], HD=hd, PAGE=page, BLOCK_N=64,
        SPLITS=splits, SHORT=short, BLOCK_O=block_o, USE_PDL=pdl_mode(pdl), num_warps=num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return acc


def attn_o_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_weight: torch.Tensor,
                     residual: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 `residual + O · softmax(q kᵀ·scale) v` for contiguous k, v [ctx, nkv, hd] (tests)."""
    nh, hd = q.shape[-2:]
    group = nh // k.shape[1]
    kk = k.float().repeat_interleave(group, 1).transpose(0, 1)  # [nh, ctx, hd]
    vv = v.float().repeat_interleave(group, 1).transpose(0, 1)
    p = torch.softmax((q.float().view(nh, 1, hd) @ kk.transpose(1, 2)) * scale, -1)
    a = (p @ vv).reshape(1, nh * hd).to(o_weight.dtype).float()
    return residual.float().view(1, -1) + a @ o_weight.float().T


__all__ = ["FX_ONE", "attn_o_b1", "attn_o_reference"]
