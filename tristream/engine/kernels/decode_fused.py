"""Batch-1 decode with fewer, overlapped launches: norm + QKV GEMV + RoPE + KV store in one kernel,
and Programmatic Dependent Launch (PDL) between the step's kernels.

At batch 1 a decode step of a small model is a chain of ~7 tiny kernels per layer, each bound
by its launch and its first round trip to memory rather than by bytes (SmolLM2-135M: ~210
kernels for 0.92 ms on an H200, against an HBM floor of 0.06 ms). Three things shorten it:

* `qkv_rope_store1` folds the rope+store kernel into the QKV GEMV's epilogue. Each program owns
  `PAIR` rows of the first half of one head and the `PAIR` matching rows of its second half, so
  the rotation pairs (i, i + head_dim/2) meet in registers: q heads are rotated into `q_out`, k
  heads rotated into the K cache, v heads copied into the V cache (slot -1: nothing written).
  Rounding follows the unfused path (the GEMV result is rounded to the weight dtype before the
  rotation); the two agree to float rounding of the K sums (tests: relative error < 1e-6).
* Split attention merges in its own kernel: the last split of each head to finish (an atomic
  count per head in persistent `counters`) merges the partial softmaxes, so the merge kernel
  goes (`triton_ops.paged_decode_attention(counters=...)`).
* With ``pdl=True`` each kernel is launched with the PDL attribute: it may start while its
  predecessor finishes, loads only constant weights before ``gdc_wait`` (which waits for the
  predecessor's memory), and lets its own successor launch early. Hopper and newer only; the
  decode graphs time it at capture and keep it only where it is faster and agrees.

The Triton interpreter (``TRITON_INTERPRET=1``) runs everything here on CPU except ``pdl=True``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tristream.engine.kernels.gemv import fused_gemv, norm_x, row_rstd
from tristream.engine.kernels.pdl import pdl_mode, pdl_start, pdl_wait
from tristream.engine.kernels.triton_ops import paged_decode_attention, rms_norm


@triton.jit
def _qkv_rope_store1_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, pos_ptr, cs_ptr, slot_ptr, q_out_ptr, kc_ptr, vc_ptr,
                            K, eps, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                            PAIR: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, LATE_NORM: tl.constexpr):
    pdl_start(USE_PDL)
    h = tl.program_id(0)  # q heads, then k heads, then v heads
    j = tl.program_id(1)  # which PAIR-row slice of the half head
    r1 = h * HD + j * PAIR + tl.arange(0, PAIR)  # rows of the first half
    r2 = r1 + HALF  # their rotation partners
    dt = w_ptr.dtype.element_ty
    rk0 = tl.arange(0, BLOCK_K)
    k0mask = rk0 < K
    # the first K tile of both weight slices: constant, so loaded before waiting on the predecessor
    w1 = tl.load(w_ptr + r1[:, None] * K + rk0[None, :], mask=k0mask[None, :], other=0.0)
    w2 = tl.load(w_ptr + r2[:, None] * K + rk0[None, :], mask=k0mask[None, :], other=0.0)
    pdl_wait(USE_PDL)
    rstd = 1.0
    if NORM and not LATE_NORM:
        rstd = row_rstd(x_ptr, K, eps, BLOCK_K)
    xv = tl.load(x_ptr + rk0, mask=k0mask, other=0.0)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    if NORM:  # LATE_NORM: one pass, the RMS scale multiplies the sums (`fused_gemv`'s late_norm)
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
    if NORM and LATE_NORM:
        rs = tl.rsqrt(tl.sum(ss, 0) / K + eps)
        acc1 = acc1 * rs
        acc2 = acc2 * rs
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + r1).to(tl.float32)
        acc2 += tl.load(b_ptr + r2).to(tl.float32)
    x1 = acc1.to(dt).to(tl.float32)  # rounded as the unfused GEMV's output would be
    x2 = acc2.to(dt).to(tl.float32)
    d1 = j * PAIR + tl.arange(0, PAIR)  # offsets inside the head
    rope_store_pair(h, d1, x1, x2, pos_ptr, cs_ptr, slot_ptr, q_out_ptr, kc_ptr, vc_ptr, NH, NKV, HD, HALF)


@triton.jit
def rope_store_pair(h, d1, x1, x2, pos_ptr, cs_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, NH: tl.constexpr,
                    NKV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr):
    """Epilogue of a QKV projection slice: rows `d1` of the first half of head `h` (`x1`) and their
    rotation partners `d1 + HALF` (`x2`), float32. q heads are rotated at `positions[0]` into
    `q_ptr`, k heads rotated into the K cache, v heads copied into the V cache, at `slots[0]`
    (-1: nothing written)."""
    if h < NH + NKV:
        pos = tl.load(pos_ptr)
        cos = tl.load(cs_ptr + pos * HD + d1)
        sin = tl.load(cs_ptr + pos * HD + HALF + d1)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        if h < NH:
            dst = q_ptr + h * HD
            tl.store(dst + d1, y1.to(q_ptr.dtype.element_ty))
            tl.store(dst + HALF + d1, y2.to(q_ptr.dtype.element_ty))
        else:
            slot = tl.load(slot_ptr).to(tl.int64)
            if slot >= 0:
                kd = kc_ptr + (slot * NKV + (h - NH)) * HD
                tl.store(kd + d1, y1.to(kc_ptr.dtype.element_ty))
                tl.store(kd + HALF + d1, y2.to(kc_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr).to(tl.int64)
        if slot >= 0:
            vd = vc_ptr + (slot * NKV + (h - NH - NKV)) * HD
            tl.store(vd + d1, x1.to(vc_ptr.dtype.element_ty))
            tl.store(vd + HALF + d1, x2.to(vc_ptr.dtype.element_ty))


def pair_rows(half: int, k: int, rows: int | None = None) -> int:
    """Rows per half-head slice of one program: half of `rows` when a tile is given, else enough
    programs to spread the weight over SMs with few enough registers for a `2·PAIR × BLOCK_K`
    tile; always a divisor of `half`."""
    p = max(1, min(rows // 2, half)) if rows is not None else (8 if k <= 1024 else 4)
    while half % p:
        p //= 2
    return max(p, 1)


def qkv_rope_store1(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
                    eps: float, positions: torch.Tensor, cos_sin: torch.Tensor, slots: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, nh: int, nkv: int, hd: int,
                    pdl: bool | int = False, tile: tuple[int, int] | None = None, num_warps: int = 4,
                    late_norm: bool = False) -> torch.Tensor:
    """Batch-1 QKV projection of `x` [1, K] (optionally RMS-normalised first) with RoPE at
    `positions[0]`; k and v go to the flat caches at `slots[0]` (-1: skipped). Returns q [1, nh, hd].
    late_norm: the one-pass norm of `gemv.fused_gemv`."""
    if x.shape[0] != 1:
        raise ValueError(f"qkv_rope_store1 is the batch-1 kernel; got {x.shape[0]} rows")
    n, k = w.shape
    if n != (nh + 2 * nkv) * hd or hd % 2:
        raise ValueError(f"weight rows {n} != (heads {nh} + 2 x kv heads {nkv}) x head_dim {hd} (even)")
    half = hd // 2
    pair = pair_rows(half, k, None if tile is None else tile[0])
    block_k = min(triton.next_power_of_2(k), 1024) if tile is None else tile[1]
    q = torch.empty(1, nh, hd, dtype=w.dtype, device=w.device)
    dummy = q
    _qkv_rope_store1_kernel[(nh + 2 * nkv, half // pair)](
        x, w, bias if bias is not None else dummy, norm_weight if norm_weight is not None else dummy,
        positions, cos_sin, slots, q, k_cache, v_cache, k, eps,
        NH=nh, NKV=nkv, HD=hd, HALF=half, PAIR=pair, NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        BLOCK_K=block_k, USE_PDL=pdl_mode(pdl), LATE_NORM=late_norm, num_warps=num_warps, **_pdl_launch(pdl),
    )
    return q


def _pdl_launch(pdl: bool | int) -> dict[str, Any]:
    return {"launch_pdl": True} if pdl else {}


TILES: dict[str, tuple[tuple[int, int] | None, int]] = {"b1": (None, 4), "bw": ((8, 2048), 4),
                                                       "b1w": ((0, 2048), 4), "b8w": ((0, 2048), 8),
                                                       "b4w": ((4, 2048), 4)}
"""Batch-1 GEMV tile (rows, K columns) and warps per program, per variant name. Which is fastest
depends on the GPU and the model; the decode graphs time them at capture.
"b1": the default per shape (8-16 rows × up to 1024 columns).
"bw": whole 2048-column rows (8 rows): a program of a K ≤ 2048 projection loads all its weights
before waiting on its predecessor (PDL); Llama-3.2-1B's choice on the H200.
"b1w", "b8w" (rows 0: per projection; 4 or 8 warps): the default tile, but K up to 2048 columns in
one tile, so that a projection with 1024 < K ≤ 2048 (SmolLM2-135M's down projection, K = 1536)
loads all its weights before the PDL wait instead of its second tile after it (`proj_tile`).
"b4w": 4 rows × the whole K (up to 2048 columns, no wider than K needs); with the early PDL
trigger and the one-pass norm ("b4w_pdle_ln_hc") SmolLM2-135M's choice on the H200."""


def proj_tile(tile: tuple[int, int] | None, k: int) -> tuple[int, int] | None:
    """The (rows, K columns) tile of one projection with K input columns under a `TILES` tile:
    None (the per-shape default); the given rows × the given columns, or fewer columns where K
    fits in fewer (a power of two ≥ K); for rows 0 the default rows of a one-tile-wide K up to the
    given columns (None where that is the default anyway, K ≤ 1024)."""
    if tile is None:
        return None
    bk = min(triton.next_power_of_2(k), tile[1])
    if tile[0] != 0:
        return (tile[0], bk)
    if bk <= 1024:
        return None
    return (8, bk)


Blocks = tuple[int | None, int | None]


def proj_blocks(model: Any, tile: tuple[int, int] | None) -> tuple[Blocks, Blocks, Blocks]:
    """(block_n, block_k) of the hidden-size input projections (QKV, gate|up, head), of O and of
    down under a `TILES` tile (None, None: the per-shape default), by `proj_tile`."""
    def blocks(k: int) -> Blocks:
        t = proj_tile(tile, k)
        return t if t is not None else (None, None)

    cfg = model.cfg
    return blocks(cfg.hidden_size), blocks(cfg.q_size), blocks(model.layers[0].down.weight.shape[1])


def decode_logits_b1(model: Any, h: torch.Tensor, attention: Any, pdl: bool | int = False,
                     tile: tuple[int, int] | None = None, num_warps: int = 4, head_cublas: bool = False,
                     late_norm: bool = False, raw_logits: bool = False) -> torch.Tensor:
    """Batch-1 decode forward: per layer norm+QKV+RoPE+store, attention (its split merge folded
    in when `attention.counters` is given), O+residual, norm+gate|up, SiLU+down+residual: 5
    kernels instead of 7, optionally chained with PDL.

    `attention` carries the step's device inputs (`positions`, `slots`, `block_tables`,
    `ctx_lens`, `cache`, `splits`, `scale`, optional `counters`), as `graphs.TritonDecodeAttention` does.
    `tile`: the GEMV tile (rows, K columns) of every projection; None: the default per shape;
    `num_warps`: warps per program of the QKV and GEMV kernels; `head_cublas`: the final norm as its
    own kernel and the output projection (the largest GEMV of a small model) through cuBLAS.
    `pdl`: False, True (each kernel lets its successor launch after its wait) or 2 (at its start;
    `kernels/pdl.py`). `late_norm`: the norm+QKV and norm+gate|up kernels (and a Triton head) norm
    in one pass (`gemv.fused_gemv`). `raw_logits`: the cuBLAS head's logits in the model dtype (no
    float32 copy; the Triton head writes float32 either way).
    """
    cfg = model.cfg
    (bn, bk), (on, ok), (dn, dk) = proj_blocks(model, tile)
    t_qkv = None if bn is None or bk is None else (bn, bk)  # the QKV kernel's tile (rows, K columns)
    eps = cfg.rms_norm_eps
    r = h
    for i, layer in enumerate(model.layers):
        kc, vc = attention.cache.flat(i)
        q = qkv_rope_store1(r, layer.qkv.weight, layer.qkv.bias, layer.input_norm, eps, attention.positions,
                            model.cos_sin, attention.slots, kc, vc, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            pdl=pdl, tile=t_qkv, num_warps=num_warps, late_norm=late_norm)
        a = paged_decode_attention(q, kc, vc, attention.block_tables, attention.ctx_lens, attention.cache.block_size,
                                   attention.scale, attention.splits, pdl=pdl,
                                   counters=getattr(attention, "counters", None)).view(1, cfg.q_size)
        r = fused_gemv(a, layer.o.weight, residual=r, pdl=pdl, block_n=on, block_k=ok, num_warps=num_warps)
        gu = fused_gemv(r, layer.gate_up.weight, norm_weight=layer.post_norm, eps=eps, pdl=pdl, block_n=bn,
                        block_k=bk, num_warps=num_warps, late_norm=late_norm)
        r = fused_gemv(gu, layer.down.weight, residual=r, silu=True, pdl=pdl, block_n=dn, block_k=dk,
                       num_warps=num_warps)
    if head_cublas:
        x = rms_norm(r, model.norm, eps, out_dtype=model.norm.dtype)
        return model.head()(x) if raw_logits else model.logits(x)
    return fused_gemv(r, model.head().weight, norm_weight=model.norm, eps=eps, pdl=pdl, block_n=bn,
                      block_k=bk, num_warps=num_warps, out_dtype=torch.float32, late_norm=late_norm)
