"""FP8 (e4m3) weight-only products for GPU decode and prefill: y = (x · codesᵀ) · scale (+ bias).

Weights are e4m3 codes [N, K] with one float32 scale per output row (`linear.quantize_fp8`);
activations stay bf16. A decode step streams every weight once, so one byte per weight instead
of two halves the floor of a step; the arithmetic is unchanged (bf16 activations, float32 sums).

* `fp8_gemv1` (batch 1): `gemv.fused_gemv`'s kernel with the weight widened from e4m3 in
  registers and the row scale applied to the sums; the same prologues (RMS norm, SiLU of a
  gate|up row), residual epilogue and PDL chaining.
* `fp8_qkv_rope_store1`: `decode_fused.qkv_rope_store1` for e4m3 weights.
* `decode_logits_b1_fp8`: `decode_fused.decode_logits_b1` over these two (5 kernels per layer).
* `fp8_gemm` (any number of rows): tiles of x times widened weight tiles on the tensor cores
  (`tl.dot`, bf16 operands, float32 accumulators), the row scale in the epilogue. Decode batches
  of 2..64 rows and prefill.
* `fp8_linear`: what `linear.Linear` runs for an fp8 weight on CUDA: the GEMV at one row, the
  tiled kernel above; prefill (more than `SMALL_M` rows) through `PREFILL_PATH`: the same Triton
  kernel ("triton") or cuBLASLt's FP8 GEMM with per-row activation scales ("scaled_mm",
  `torch._scaled_mm`; the activations are rounded to e4m3 too).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tristream.engine.kernels.decode_fused import _pdl_launch, pair_rows, proj_tile, rope_store_pair
from tristream.engine.kernels.gemv import norm_x, row_rstd
from tristream.engine.kernels.pdl import pdl_mode, pdl_start, pdl_wait
from tristream.engine.kernels.triton_ops import paged_decode_attention, rms_norm

SMALL_M = 128
"""Rows up to which `fp8_linear` uses the decode tiles (the largest decode bucket; larger:
`PREFILL_PATH`)."""
PREFILL_PATH = "triton"
"""'triton' (`fp8_gemm` with prefill tiles) or 'scaled_mm' (`torch._scaled_mm`, activations
rounded to e4m3 with a scale per row)."""
FP8_MAX = 448.0


@triton.jit
def _fp8_gemv1_kernel(x_ptr, w_ptr, s_ptr, b_ptr, res_ptr, nw_ptr, out_ptr, N, K, eps,
                      NORM: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                      LATE_NORM: tl.constexpr):
    """`gemv._fused_gemv1_kernel` for e4m3 weights: `dt` (the rounding of the normalised row and of
    the product) is x's dtype; the first weight tile and the row scales load before the PDL wait."""
    pdl_start(USE_PDL)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    dt = x_ptr.dtype.element_ty
    rk0 = tl.arange(0, BLOCK_K)
    w0 = tl.load(w_ptr + rn[:, None] * K + rk0[None, :], mask=nmask[:, None] & (rk0 < K)[None, :], other=0.0)
    sc = tl.load(s_ptr + rn, mask=nmask, other=0.0)
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
    acc = acc * sc
    if NORM and LATE_NORM:
        acc = acc * tl.rsqrt(tl.sum(ss, 0) / K + eps)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    y = acc.to(dt)
    if HAS_RES:
        r = tl.load(res_ptr + rn, mask=nmask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rn, y, mask=nmask)


def fp8_gemv1(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
              eps: float = 1e-6, silu: bool = False, block_n: int | None = None, block_k: int | None = None,
              pdl: bool | int = False, num_warps: int | None = None, out_dtype: torch.dtype | None = None,
              late_norm: bool = False) -> torch.Tensor:
    """`gemv.fused_gemv` for e4m3 codes `w` [N, K] and row scales `scale` [N] (float32): x [1, K]
    (gate|up [1, 2K] with silu) → [1, N] in `out_dtype` (default x's)."""
    n, k = w.shape
    if x.shape[0] != 1:
        raise ValueError(f"fp8_gemv1 takes one row (batch-1 decode), got {x.shape[0]}")
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=w.device)
    dummy = out
    bk = block_k or min(triton.next_power_of_2(k), 1024)
    bn = block_n or (8 if bk >= 1024 else 16)
    _fp8_gemv1_kernel[(triton.cdiv(n, bn),)](
        x, w, scale, bias if bias is not None else dummy, residual if residual is not None else dummy,
        norm_weight if norm_weight is not None else dummy, out, n, k, eps,
        NORM=norm_weight is not None, SILU=silu, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl_mode(pdl), LATE_NORM=late_norm, num_warps=num_warps or 4,
        **_pdl_launch(pdl),
    )
    return out


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
        r = fp8_gemv1(a, o["w"], o["s"], residual=r, pdl=pdl, block_n=on, block_k=ok, num_warps=num_warps)
        gu = fp8_gemv1(r, gu_w["w"], gu_w["s"], norm_weight=layer.post_norm, eps=eps, pdl=pdl, block_n=bn,
                       block_k=bk, num_warps=num_warps, late_norm=late_norm)
        r = fp8_gemv1(gu, down["w"], down["s"], residual=r, silu=True, pdl=pdl, block_n=dn, block_k=dk,
                      num_warps=num_warps)
    head = model.head()
    if head_cublas or head.qformat != "fp8":
        x = rms_norm(r, model.norm, eps, out_dtype=model.norm.dtype)
        return head(x) if raw_logits else model.logits(x)
    t = head.qtensors
    return fp8_gemv1(r, t["w"], t["s"], norm_weight=model.norm, eps=eps, pdl=pdl, block_n=bn, block_k=bk,
                     num_warps=num_warps, out_dtype=torch.float32, late_norm=late_norm)


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """out [M, N] = (x [M, K] · widen(w [N, K])ᵀ) · s[n] (+ b[n]); x and out row-major, x's dtype."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n  # programs of GROUP_M row tiles share the weight tiles they read
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + kk[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0)
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + kk[:, None], mask=nmask[None, :] & kmask[:, None],
                    other=0.0)
        acc = tl.dot(a, b.to(dt), acc)
    acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def gemm_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of `fp8_gemm` for an [m, k] × [n, k] product:
    decode batches (m ≤ SMALL_M) take all rows in one tile and narrow weight tiles, so that enough
    programs stream the weight; prefill takes square tiles."""
    if m <= SMALL_M:
        bm = max(16, triton.next_power_of_2(m))
        bn = 16 if n <= 4096 else 32 if n <= 8192 else 64
        if bm <= 32:
            return bm, bn, 256, 4, 4
        return bm, bn, 128, 4 if bm <= 64 else 8, 4 if bm <= 64 else 3
    return 128, 128, 64, 8, 3


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (contiguous, bf16/fp16/fp32) × e4m3 codes `w` [N, K] with row scales → [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps, stages = config or gemm_config(m, n, k)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_gemm_kernel[grid](x, w, scale, bias if bias is not None else out, out, m, n, k,
                           HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                           num_warps=warps, num_stages=stages)
    return out


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] → (e4m3 [M, K], float32 scale [M, 1]) per row (for `torch._scaled_mm`)."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    sx = amax / FP8_MAX
    return (x.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), sx


def scaled_mm_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """cuBLASLt's FP8 GEMM (`torch._scaled_mm`, row-wise scales): x rounded to e4m3 per row."""
    xq, sx = quantize_rows_fp8(x)
    y = torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    return y if bias is None else y + bias


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [M, K] → [M, N] for an fp8 weight (`Linear`'s CUDA path; module docstring)."""
    if not x.is_contiguous():
        x = x.contiguous()
    m = x.shape[0]
    if m == 1:
        return fp8_gemv1(x, w, scale, bias=bias)
    if m > SMALL_M and PREFILL_PATH == "scaled_mm":
        return scaled_mm_linear(x, w, scale, bias)
    return fp8_gemm(x, w, scale, bias)
