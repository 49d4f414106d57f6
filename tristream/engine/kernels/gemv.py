"""Batch-1 decode GEMV with the neighbouring elementwise work folded in.

    y = W · prologue(x) (+ bias) (+ residual)

where the prologue is nothing, an RMSNorm of the row (recomputed per program: the row is small
and already in L2), or silu(gate) · up of a gate|up row, so that a decode step is bound by
fewer launches (`decode_fused.py`). Rounding follows the torch path: the normalised row is cast
to the weight dtype before the product, the product is rounded before the residual add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tristream.engine.kernels.pdl import pdl_mode, pdl_start, pdl_wait


@triton.jit
def norm_x(xv, nw, rstd, ss, dt: tl.constexpr, LATE_NORM: tl.constexpr):
    """One K tile of x under the RMS norm → (the tile to multiply the weights by, ss): with LATE_NORM
    x·nw in float32 and the squares added to `ss` (the scale comes after the sums); else x·rstd
    rounded to `dt`, times nw, rounded (as transformers' RMSNorm), `ss` as given."""
    if LATE_NORM:
        xf = xv.to(tl.float32)
        ss = ss + xf * xf
        out = xf * nw.to(tl.float32)
    else:
        out = ((xv.to(tl.float32) * rstd).to(dt).to(tl.float32) * nw.to(tl.float32)).to(dt)
    return out, ss


@triton.jit
def row_rstd(x_ptr, K, eps, BLOCK_K: tl.constexpr):
    """1 / RMS of the row x[0:K] (float32), read in BLOCK_K tiles."""
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        ss += xv * xv
    return tl.rsqrt(tl.sum(ss, 0) / K + eps)


@triton.jit
def _fused_gemv1_kernel(x_ptr, w_ptr, b_ptr, res_ptr, nw_ptr, out_ptr, N, K, eps,
                        NORM: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                        LATE_NORM: tl.constexpr):
    """A plain GEMV, products summed in float32 on the CUDA cores. The first K
    tile of the weight is loaded first; with PDL, before waiting on the previous kernel. The
    product is rounded to the weight dtype; the residual sum is kept in the output's dtype (a
    float32 output keeps an unrounded residual stream). LATE_NORM (with NORM): one pass over x,
    the RMS scale applied to the products' sums (`late_norm` of `fused_gemv`)."""
    pdl_start(USE_PDL)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    dt = w_ptr.dtype.element_ty
    # The first K tile is loaded before anything else (with PDL: while the predecessor finishes).
    # Also without PDL: a plain loop (which the compiler pipelines through shared memory) measured
    # slower on the H200 (b1: SmolLM2-135M 0.63 -> 0.83 ms per step, Llama-3.2-1B 0.97 -> 1.32).
    rk0 = tl.arange(0, BLOCK_K)
    w0 = tl.load(w_ptr + rn[:, None] * K + rk0[None, :], mask=nmask[:, None] & (rk0 < K)[None, :], other=0.0)
    pdl_wait(USE_PDL)
    rstd = 1.0
    if NORM and not LATE_NORM:
        rstd = row_rstd(x_ptr, K, eps, BLOCK_K)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        if SILU:
            g = tl.load(x_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + K + rk, mask=kmask, other=0.0)
            xv = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u.to(tl.float32)).to(dt)
        else:
            xv = tl.load(x_ptr + rk, mask=kmask, other=0.0)
            if NORM:
                xv, ss = norm_x(xv, tl.load(nw_ptr + rk, mask=kmask, other=0.0), rstd, ss, dt, LATE_NORM)
        if k0 == 0:
            w = w0
        else:
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xv.to(tl.float32)[None, :], 1)
    if NORM and LATE_NORM:
        acc = acc * tl.rsqrt(tl.sum(ss, 0) / K + eps)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    y = acc.to(dt)
    if HAS_RES:
        r = tl.load(res_ptr + rn, mask=nmask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rn, y, mask=nmask)


def fused_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
               eps: float = 1e-6, silu: bool = False, block_n: int | None = None, block_k: int | None = None,
               pdl: bool | int = False, num_warps: int | None = None, out_dtype: torch.dtype | None = None,
               late_norm: bool = False) -> torch.Tensor:
    """x [1, K] (or gate|up [1, 2K] with silu) → [1, N] for a weight W [N, K].

    pdl: launch with Programmatic Dependent Launch (Hopper+; see `decode_fused.py`).
    block_n / block_k: the tile (default: per shape); the decode graphs time a few tiles at
    capture and keep the fastest; num_warps: warps per program (default 4). `out_dtype` (default
    the weight's; float32 keeps the residual sum unrounded, or returns float32 logits).
    `late_norm` (with `norm_weight`): x is read once; the products of the weights with
    x·norm_weight (float32, not rounded) and the sum of squares are summed together, and the RMS
    scale multiplies the sums (no block-wide reduction and no second read of x before the
    products). The rounding differs from the two-pass norm (which rounds the normalised x to the
    weight dtype, as transformers' RMSNorm does) by about one unit in the last place of bf16 per
    element of x."""
    n, k = w.shape
    if x.shape[0] != 1:
        raise ValueError(f"fused_gemv takes one row (batch-1 decode), got {x.shape[0]}")
    out = torch.empty(1, n, dtype=out_dtype or w.dtype, device=w.device)
    dummy = out
    bk = block_k or min(triton.next_power_of_2(k), 1024)
    bn = block_n or (8 if bk >= 1024 else 16)
    _fused_gemv1_kernel[(triton.cdiv(n, bn),)](
        x, w, bias if bias is not None else dummy, residual if residual is not None else dummy,
        norm_weight if norm_weight is not None else dummy, out, n, k, eps,
        NORM=norm_weight is not None, SILU=silu, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl_mode(pdl), LATE_NORM=late_norm, num_warps=num_warps or 4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
