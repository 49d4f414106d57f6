"""FP8 (e4m3) weight-only products for GPU decode and prefill: y = (x · codesᵀ) · scale (+ bias).

Weights are e4m3 codes [N, K] with one float32 scale per output row (`linear.quantize_fp8`);
activations stay bf16. A decode step streams every weight once, so one byte per weight instead
of two halves the floor of a step; the arithmetic is unchanged (bf16 activations, float32 sums).

* `fp8_gemv1` (batch 1): `gemv.fused_gemv`'s kernel with the weight widened from e4m3 in
  registers and the row scale applied to the sums; the same prologues (RMS norm, SiLU of a
  gate|up row), residual epilogue and PDL chaining.
* `fp8_decode.py`: the batch-1 fused decode over these kernels; `fp8_tune.py`: the per-shape
  kernel choice (`tune_model`) that fills `TUNED`.
* `fp8_mm` (any number of rows): tiles of x times widened weight tiles on the tensor cores
  (`tl.dot`, bf16 operands, float32 accumulators), the row scale in the epilogue, the same
  prologues and residual epilogue as the GEMV.
* `fp8_linear`: what `linear.Linear` runs for an fp8 weight on CUDA: per shape and row bucket
  the `Config` that `fp8_tune.tune_model` timed fastest on this device (GEMV tiles at one row,
  tensor-core tiles, and for prefill also the weight widened to bf16 once and cuBLAS, or
  cuBLASLt's FP8 GEMM where `PREFILL_PATH` allows it), else `default_config`. The batch-1 fused
  decode takes the tensor-core kernel too where it was timed faster.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tristream.engine.kernels.decode_fused import _pdl_launch
from tristream.engine.kernels.gemv import norm_x, row_rstd
from tristream.engine.kernels.pdl import pdl_mode, pdl_start, pdl_wait

SMALL_M = 128
"""Rows up to which `fp8_linear` uses the decode tiles (the largest decode bucket; larger:
`PREFILL_PATH`)."""
PREFILL_PATH = "weight_only"
"""'weight_only' (prefill candidates keep bf16 activations) or 'scaled_mm' (also time
`torch._scaled_mm`, which rounds the activations to e4m3 with a scale per row)."""
FP8_MAX = 448.0


@triton.jit
def _x_tile(x_ptr, nw_ptr, rk, kmask, K, rstd, ss, dt: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr,
            LATE_NORM: tl.constexpr):
    """One K tile of the GEMV's input row after its prologue (SiLU of gate|up, or the RMS norm)."""
    if SILU:
        g = tl.load(x_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + rk, mask=kmask, other=0.0)
        xv = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u.to(tl.float32)).to(dt)
    else:
        xv = tl.load(x_ptr + rk, mask=kmask, other=0.0)
        if NORM:
            xv, ss = norm_x(xv, tl.load(nw_ptr + rk, mask=kmask, other=0.0), rstd, ss, dt, LATE_NORM)
    return xv, ss


@triton.jit
def _fp8_gemv1_kernel(x_ptr, w_ptr, s_ptr, b_ptr, res_ptr, nw_ptr, out_ptr, N, K, eps,
                      NORM: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                      LATE_NORM: tl.constexpr, UNROLL: tl.constexpr):
    """`gemv._fused_gemv1_kernel` for e4m3 weights: `dt` (the rounding of the normalised row and of
    the product) is x's dtype; the first weight tile(s) and the row scales load before the PDL
    wait. UNROLL 2: two K tiles per iteration, both loaded before either is used (twice the
    bytes in flight per thread)."""
    pdl_start(USE_PDL)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    dt = x_ptr.dtype.element_ty
    rk0 = tl.arange(0, BLOCK_K)
    wrow = w_ptr + rn[:, None].to(tl.int64) * K
    w0 = tl.load(wrow + rk0[None, :], mask=nmask[:, None] & (rk0 < K)[None, :], other=0.0)
    if UNROLL == 2:
        w1 = tl.load(wrow + BLOCK_K + rk0[None, :], mask=nmask[:, None] & (BLOCK_K + rk0 < K)[None, :], other=0.0)
    sc = tl.load(s_ptr + rn, mask=nmask, other=0.0)
    pdl_wait(USE_PDL)
    rstd = 1.0
    if NORM and not LATE_NORM:
        rstd = row_rstd(x_ptr, K, eps, BLOCK_K)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if UNROLL == 2:
        for k0 in range(0, K, 2 * BLOCK_K):
            rka = k0 + rk0
            rkb = rka + BLOCK_K
            ma = rka < K
            mb = rkb < K
            if k0 == 0:
                wa = w0
                wb = w1
            else:
                wa = tl.load(wrow + rka[None, :], mask=nmask[:, None] & ma[None, :], other=0.0)
                wb = tl.load(wrow + rkb[None, :], mask=nmask[:, None] & mb[None, :], other=0.0)
            xa, ss = _x_tile(x_ptr, nw_ptr, rka, ma, K, rstd, ss, dt, NORM, SILU, LATE_NORM)
            xb, ss = _x_tile(x_ptr, nw_ptr, rkb, mb, K, rstd, ss, dt, NORM, SILU, LATE_NORM)
            acc += tl.sum(wa.to(tl.float32) * xa.to(tl.float32)[None, :] + wb.to(tl.float32) * xb.to(tl.float32)[None, :], 1)
    else:
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + rk0
            kmask = rk < K
            xv, ss = _x_tile(x_ptr, nw_ptr, rk, kmask, K, rstd, ss, dt, NORM, SILU, LATE_NORM)
            if k0 == 0:
                w = w0
            else:
                w = tl.load(wrow + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
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


@triton.jit
def _fp8_gemvm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A few rows (M ≤ ROWS ≤ 8) on the CUDA cores: each weight tile is read once and multiplied by
    every row (x [M, K] row-major, out [M, N] in x's dtype)."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rk0 = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, ROWS)
    wrow = w_ptr + rn[:, None].to(tl.int64) * K
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        kmask = rk < K
        w = tl.load(wrow + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + rows[:, None] * K + rk[None, :], mask=(rows < M)[:, None] & kmask[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.sum(xv[:, None, :] * w[None, :, :], 2)
    acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & nmask[None, :])


def fp8_gemvm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              block_n: int = 16, block_k: int = 64, num_warps: int = 4) -> torch.Tensor:
    """x [M, K] (M ≤ 8, contiguous) × e4m3 `w` [N, K] with row scales → [M, N] (`_fp8_gemvm_kernel`)."""
    m, k = x.shape
    n = w.shape[0]
    if m > 8:
        raise ValueError(f"fp8_gemvm takes at most 8 rows, got {m}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _fp8_gemvm_kernel[(triton.cdiv(n, block_n),)](x, w, scale, bias if bias is not None else out, out, m, n, k,
                                                  HAS_BIAS=bias is not None, ROWS=max(2, triton.next_power_of_2(m)),
                                                  BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out


def fp8_gemv1(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
              eps: float = 1e-6, silu: bool = False, block_n: int | None = None, block_k: int | None = None,
              pdl: bool | int = False, num_warps: int | None = None, out_dtype: torch.dtype | None = None,
              late_norm: bool = False, unroll: int = 1) -> torch.Tensor:
    """`gemv.fused_gemv` for e4m3 codes `w` [N, K] and row scales `scale` [N] (float32): x [1, K]
    (gate|up [1, 2K] with silu) → [1, N] in `out_dtype` (default x's); unroll 1 or 2 K tiles per
    iteration."""
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
        BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl_mode(pdl), LATE_NORM=late_norm, UNROLL=unroll,
        num_warps=num_warps or 4, **_pdl_launch(pdl),
    )
    return out


@triton.jit
def _fp8_mm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, res_ptr, nw_ptr, out_ptr, M, N, K, eps,
                   NORM: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                   USE_PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out [M, N] = prologue(x) · widen(w)ᵀ · s[n] (+ b[n]), rounded to x's dtype (+ residual).

    x row-major [M, K] (SILU: gate|up [M, 2K]); the prologues of `_fp8_gemv1_kernel` per row
    (NORM: the two-pass RMS norm, rounded as transformers does). EARLY: the first weight tile
    and the scales load before the PDL wait (decode); off for prefill tiles (a plain loop the
    compiler pipelines)."""
    pdl_start(USE_PDL)
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
    xs = 2 * K if SILU else K
    xrow = x_ptr + rm[:, None].to(tl.int64) * xs
    wcol = w_ptr + rn[None, :].to(tl.int64) * K
    if EARLY:
        b0 = tl.load(wcol + rk[:, None], mask=nmask[None, :] & (rk < K)[:, None], other=0.0)
    sc = tl.load(s_ptr + rn, mask=nmask, other=0.0)
    pdl_wait(USE_PDL)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    if NORM:
        ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            xv = tl.load(xrow + kk[None, :], mask=mmask[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
            ss += xv * xv
        rstd = tl.rsqrt(tl.sum(ss, 1) / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        amask = mmask[:, None] & kmask[None, :]
        if SILU:
            g = tl.load(xrow + kk[None, :], mask=amask, other=0.0).to(tl.float32)
            u = tl.load(xrow + K + kk[None, :], mask=amask, other=0.0)
            a = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u.to(tl.float32)).to(dt)
        else:
            a = tl.load(xrow + kk[None, :], mask=amask, other=0.0)
            if NORM:
                nw = tl.load(nw_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
                a = ((a.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32) * nw[None, :]).to(dt)
        if EARLY:
            if k0 == 0:
                b = b0
            else:
                b = tl.load(wcol + kk[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        else:
            b = tl.load(wcol + kk[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(a, b.to(dt), acc)
    acc = acc * sc[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    omask = mmask[:, None] & nmask[None, :]
    optr = rm[:, None].to(tl.int64) * N + rn[None, :]
    y = acc.to(dt)
    if HAS_RES:
        r = tl.load(res_ptr + optr, mask=omask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + optr, y, mask=omask)


@triton.jit
def _fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [N, K] = widen(w) · s[n], rounded to out's dtype."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    off = rn[:, None].to(tl.int64) * K + rk[None, :]
    w = tl.load(w_ptr + off, mask=mask, other=0.0).to(tl.float32)
    sc = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    tl.store(out_ptr + off, (w * sc[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


Config = tuple[Any, ...]
"""A kernel choice for one product: ("gemv", rows, K columns, warps, unroll) (one row), ("gemvm",
rows, K columns, warps) (up to 8 rows on the CUDA cores), ("mm", BLOCK_M,
BLOCK_N, BLOCK_K, warps, stages), ("dequant",) (the weight widened to x's dtype, then cuBLAS) or
("scaled_mm",) (cuBLASLt FP8, activations rounded to e4m3 per row)."""

TUNED: dict[tuple[int, int, int], Config] = {}
"""(row bucket, N, K) → the fastest `Config` timed on this device (`tune_model`); row bucket: 1,
a power of two up to SMALL_M, or 0 for prefill (more than SMALL_M rows)."""


def row_bucket(m: int) -> int:
    return 0 if m > SMALL_M else triton.next_power_of_2(m)


def default_config(m: int, n: int, k: int) -> Config:
    """The choice before (or without) tuning."""
    if m == 1:
        bk = min(triton.next_power_of_2(k), 512)
        return ("gemv", 16, bk, 4)
    if m <= SMALL_M:
        bm = max(16, triton.next_power_of_2(m))
        if bm <= 32:
            return ("mm", bm, 32, 128, 4, 4)
        return ("mm", bm, 64, 128, 4 if bm <= 64 else 8, 4 if bm <= 64 else 3)
    return ("dequant",)


def fp8_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
           silu: bool = False, config: Config | None = None, pdl: bool | int = False) -> torch.Tensor:
    """x [M, K] (gate|up [M, 2K] with silu; contiguous) × e4m3 codes `w` [N, K] with row scales →
    [M, N] in x's dtype (the residual's with one), on the tensor cores (`_fp8_mm_kernel`)."""
    m = x.shape[0]
    n, k = w.shape
    out = torch.empty(m, n, dtype=residual.dtype if residual is not None else x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or (default_config(max(m, 2), n, k) if m <= SMALL_M else ("mm", 128, 128, 64, 8, 3))
    _, bm, bn, bk, warps, stages = cfg
    dummy = out
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_mm_kernel[grid](x, w, scale, bias if bias is not None else dummy, residual if residual is not None else dummy,
                         norm_weight if norm_weight is not None else dummy, out, m, n, k, eps,
                         NORM=norm_weight is not None, SILU=silu, HAS_BIAS=bias is not None,
                         HAS_RES=residual is not None, USE_PDL=pdl_mode(pdl), EARLY=m <= SMALL_M,
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
                         **_pdl_launch(pdl))
    return out


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """`fp8_mm` without prologue; config (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    return fp8_mm(x, w, scale, bias, config=("mm", *config) if config else None)


def dequantize_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Prefill: the weight widened to x's dtype (one pass), then cuBLAS."""
    n, k = w.shape
    wd = torch.empty(n, k, dtype=x.dtype, device=x.device)
    _fp8_dequant_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 256))](w, scale, wd, n, k, BLOCK_N=32, BLOCK_K=256,
                                                                    num_warps=4)
    return torch.nn.functional.linear(x, wd, bias)


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


def run_config(cfg: Config, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (contiguous) times an fp8 weight through one `Config`."""
    if cfg[0] == "gemv":
        return fp8_gemv1(x, w, scale, bias=bias, block_n=cfg[1], block_k=cfg[2], num_warps=cfg[3],
                         unroll=cfg[4] if len(cfg) > 4 else 1)
    if cfg[0] == "gemvm":
        return fp8_gemvm(x, w, scale, bias, block_n=cfg[1], block_k=cfg[2], num_warps=cfg[3])
    if cfg[0] == "mm":
        return fp8_mm(x, w, scale, bias, config=cfg)
    if cfg[0] == "dequant":
        return dequantize_linear(x, w, scale, bias)
    return scaled_mm_linear(x, w, scale, bias)


def config_for(m: int, n: int, k: int) -> Config:
    cfg = TUNED.get((row_bucket(m), n, k)) or default_config(m, n, k)
    if (cfg[0] == "gemv" and m != 1) or (cfg[0] == "gemvm" and m > 8):
        return default_config(m, n, k)
    return cfg


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [M, K] → [M, N] for an fp8 weight (`Linear`'s CUDA path): the tuned kernel for the shape
    and row bucket (`tune_model`), else `default_config`."""
    if not x.is_contiguous():
        x = x.contiguous()
    n, k = w.shape
    return run_config(config_for(x.shape[0], n, k), x, w, scale, bias)
