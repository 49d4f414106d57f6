"""Triton kernels for the decode step: fused add+RMSNorm, SiLU·mul, rope+KV store, paged attention.

Decode at small batch is launch-bound, so each kernel fuses what torch would run as several
(the residual add into the norm, rope into the cache write). Paged decode attention splits
long contexts over `splits` programs per head and merges the partial softmaxes in a second
kernel; with one split it writes the output directly. Padded batch rows (slot -1, context
length 0) write nothing to the cache and produce zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tristream.engine.kernels.pdl import pdl_mode, pdl_start, pdl_wait


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, N, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
        xr = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * N + offs, xr, mask=m)
        x = xr.to(tl.float32)
    var = tl.sum(x * x, 0) / N
    y = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + row * N + offs, (w * y).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm of rows of a contiguous [T, N] tensor (output in `out_dtype`, default x's)."""
    out = torch.empty_like(x, dtype=out_dtype or x.dtype)
    n = x.shape[-1]
    _rms_norm_kernel[(x.shape[0],)](x, x, w, out, out, n, eps, HAS_RES=False, BLOCK=triton.next_power_of_2(n))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one pass."""
    out = torch.empty_like(x)
    res = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm_kernel[(x.shape[0],)](x, residual, w, out, res, n, eps, HAS_RES=True,
                                    BLOCK=triton.next_power_of_2(n))
    return out, res


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    g = tl.load(gu_ptr + row * 2 * inter + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + offs, mask=m, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * inter + offs, (s * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a contiguous [T, 2I] gate|up tensor."""
    t, two_i = gu.shape
    i = two_i // 2
    out = torch.empty(t, i, dtype=gu.dtype, device=gu.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(i, block))](gu, out, i, BLOCK=block)
    return out


@triton.jit
def _rope_store_kernel(qkv_ptr, pos_ptr, cs_ptr, slot_ptr, q_out_ptr, kc_ptr, vc_ptr, qkv_stride,
                       NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    offs = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * HD + offs)
    sin = tl.load(cs_ptr + pos * HD + HALF + offs)
    base = qkv_ptr + t * qkv_stride
    if h < NH:
        x1 = tl.load(base + h * HD + offs).to(tl.float32)
        x2 = tl.load(base + h * HD + HALF + offs).to(tl.float32)
        dst = q_out_ptr + (t * NH + h) * HD
        tl.store(dst + offs, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty))
    else:
        kh = h - NH
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            kb = base + NH * HD + kh * HD
            x1 = tl.load(kb + offs).to(tl.float32)
            x2 = tl.load(kb + HALF + offs).to(tl.float32)
            kd = kc_ptr + (slot * NKV + kh) * HD
            tl.store(kd + offs, (x1 * cos - x2 * sin).to(kc_ptr.dtype.element_ty))
            tl.store(kd + HALF + offs, (x2 * cos + x1 * sin).to(kc_ptr.dtype.element_ty))
            vb = base + (NH + NKV) * HD + kh * HD
            vd = vc_ptr + (slot * NKV + kh) * HD
            tl.store(vd + offs, tl.load(vb + offs).to(vc_ptr.dtype.element_ty))
            tl.store(vd + HALF + offs, tl.load(vb + HALF + offs).to(vc_ptr.dtype.element_ty))


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, slots: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, nh: int, nkv: int, hd: int) -> torch.Tensor:
    """Rotate q (returned [T, nh, hd]) and k; write k and v into the flat caches at `slots` (-1: skip)."""
    t = qkv.shape[0]
    q = torch.empty(t, nh, hd, dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(t, nh + nkv)](qkv, positions, cos_sin, slots, q, k_cache, v_cache, qkv.stride(0),
                                      NH=nh, NKV=nkv, HD=hd, HALF=hd // 2)
    return q


@triton.jit
def attend_span(q, kc_ptr, vc_ptr, bt_row, start, end, kvh, NKV: tl.constexpr, HD: tl.constexpr,
                PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CACHE: tl.constexpr):
    """Online softmax of one query `q` ([HD] float32, already scaled) over the paged context
    positions [start, end) of kv head `kvh`; `bt_row` points at the sequence's block table.
    Returns (running max, sum of weights, weighted sum of values [HD]). CACHE: the cache modifier
    of the K/V loads ("" or ".cg" where another SM may just have written them)."""
    return attend_tiles(q, kc_ptr, vc_ptr, bt_row, start, end, kvh, tl.full([], -float("inf"), tl.float32),
                        tl.full([], 0.0, tl.float32), tl.zeros([HD], dtype=tl.float32), NKV, HD, PAGE, BLOCK_N, CACHE)


@triton.jit
def attend_tiles(q, kc_ptr, vc_ptr, bt_row, start, end, kvh, m_i, l_i, acc, NKV: tl.constexpr, HD: tl.constexpr,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CACHE: tl.constexpr):
    """`attend_span` continuing from an online-softmax state (m_i, l_i, acc)."""
    d = tl.arange(0, HD)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        mask = n < end
        page = tl.load(bt_row + n // PAGE, mask=mask, other=0).to(tl.int64)
        slot = page * PAGE + n % PAGE
        off = (slot[:, None] * NKV + kvh) * HD + d[None, :]
        k = tl.load(kc_ptr + off, mask=mask[:, None], other=0.0, cache_modifier=CACHE).to(tl.float32)
        v = tl.load(vc_ptr + off, mask=mask[:, None], other=0.0, cache_modifier=CACHE).to(tl.float32)
        m_i, l_i, acc = softmax_tile(q, k, v, mask, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def softmax_tile(q, k, v, mask, m_i, l_i, acc):
    """One tile of the online softmax: k, v [BLOCK_N, HD] float32, `mask` the valid rows (an
    all-masked tile leaves the state as it was, also the empty state m_i = -inf)."""
    sc = tl.sum(k * q[None, :], 1)
    sc = tl.where(mask, sc, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 0))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.exp(sc - m_safe)
    alpha = tl.exp(m_i - m_safe)
    acc = acc * alpha + tl.sum(p[:, None] * v, 0)
    l_i = l_i * alpha + tl.sum(p, 0)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr, bt_stride,
                         scale, NH: tl.constexpr, NKV: tl.constexpr, GROUP: tl.constexpr, HD: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
                         FUSED_MERGE: tl.constexpr, SHORT: tl.constexpr):
    pdl_start(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    if SHORT > 0:
        # a context of at most SHORT positions: split 0 of each head does it all, its old positions
        # loaded as one tile before the wait, no partials and no merge (the other splits idle)
        ctx0 = tl.load(ctx_ptr + b)
        if ctx0 <= SHORT:
            if s == 0:
                short_context(q_ptr, kc_ptr, vc_ptr, bt_ptr + b * bt_stride, ctx0, out_ptr, b, h, scale, NH, NKV,
                              GROUP, HD, PAGE, SHORT, USE_PDL)
        else:
            split_context(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr, bt_stride,
                          scale, b, h, s, NH, NKV, GROUP, HD, PAGE, BLOCK_N, SPLITS, USE_PDL, FUSED_MERGE)
    else:
        split_context(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr, bt_stride,
                      scale, b, h, s, NH, NKV, GROUP, HD, PAGE, BLOCK_N, SPLITS, USE_PDL, FUSED_MERGE)


@triton.jit
def short_context(q_ptr, kc_ptr, vc_ptr, bt_row, ctx, out_ptr, b, h, scale, NH: tl.constexpr, NKV: tl.constexpr,
                  GROUP: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr, SHORT: tl.constexpr,
                  USE_PDL: tl.constexpr):
    """One query over a whole context of ≤ SHORT positions in one program (`short_attend`), stored."""
    o = short_attend(q_ptr, kc_ptr, vc_ptr, bt_row, ctx, b, h, scale, NH, NKV, GROUP, HD, PAGE, SHORT, USE_PDL)
    tl.store(out_ptr + (b * NH + h) * HD + tl.arange(0, HD), o.to(out_ptr.dtype.element_ty))


@triton.jit
def short_attend(q_ptr, kc_ptr, vc_ptr, bt_row, ctx, b, h, scale, NH: tl.constexpr, NKV: tl.constexpr,
                 GROUP: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr, SHORT: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """One query over a whole context of ≤ SHORT positions → its output [HD] (float32). The old
    positions (all but the newest, written by earlier steps) are loaded before the PDL wait and
    kept in the cache dtype; the newest row (this step's QKV kernel wrote it) and q after it."""
    kvh = h // GROUP
    d = tl.arange(0, HD)
    n = tl.arange(0, SHORT)
    old = n < ctx - 1
    page = tl.load(bt_row + n // PAGE, mask=old, other=0).to(tl.int64)
    off = ((page * PAGE + n % PAGE)[:, None] * NKV + kvh) * HD + d[None, :]
    k = tl.load(kc_ptr + off, mask=old[:, None], other=0.0)
    v = tl.load(vc_ptr + off, mask=old[:, None], other=0.0)
    last = tl.maximum(ctx - 1, 0)
    new_off = ((tl.load(bt_row + last // PAGE).to(tl.int64) * PAGE + last % PAGE) * NKV + kvh) * HD + d
    pdl_wait(USE_PDL)
    has_new = ctx > 0
    k_new = tl.load(kc_ptr + new_off, mask=(d < HD) & has_new, other=0.0).to(tl.float32)
    v_new = tl.load(vc_ptr + new_off, mask=(d < HD) & has_new, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + (b * NH + h) * HD + d).to(tl.float32) * scale
    sc = tl.sum(k.to(tl.float32) * q[None, :], 1)
    sc = tl.where(old, sc, -float("inf"))
    sc_new = tl.where(has_new, tl.sum(k_new * q, 0), -float("inf"))
    m = tl.maximum(tl.max(sc, 0), sc_new)
    m = tl.where(m == -float("inf"), 0.0, m)
    p = tl.exp(sc - m)
    p_new = tl.exp(sc_new - m)
    acc = tl.sum(p[:, None] * v.to(tl.float32), 0) + p_new * v_new
    return acc / tl.maximum(tl.sum(p, 0) + p_new, 1e-30)


@triton.jit
def split_context(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr, bt_stride, scale,
                  b, h, s, NH: tl.constexpr, NKV: tl.constexpr, GROUP: tl.constexpr, HD: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
                  FUSED_MERGE: tl.constexpr):
    """Split `s` of (row b, head h): its span of the context, then (SPLITS > 1) its partial softmax,
    merged by a second kernel or (FUSED_MERGE) by the last split to finish. Returns 1 where this
    program stored the head's output (SPLITS == 1, or the merging split), else 0."""
    # Before waiting on the previous kernel (PDL): the context length and block table (host-written
    # before the graph) and the first tile of K/V except the newest position — every other
    # position was written by earlier steps. The newest row (written by this step's QKV kernel)
    # and q are read after the wait. Without PDL the same order runs (one more masked load).
    ctx = tl.load(ctx_ptr + b)
    kvh = h // GROUP
    per_split = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    start = s * per_split
    end = tl.minimum(start + per_split, ctx)
    d = tl.arange(0, HD)
    bt_row = bt_ptr + b * bt_stride
    n = start + tl.arange(0, BLOCK_N)
    valid = n < end
    page = tl.load(bt_row + n // PAGE, mask=valid, other=0).to(tl.int64)
    off = ((page * PAGE + n % PAGE)[:, None] * NKV + kvh) * HD + d[None, :]
    old = valid & (n < ctx - 1)
    k = tl.load(kc_ptr + off, mask=old[:, None], other=0.0)
    v = tl.load(vc_ptr + off, mask=old[:, None], other=0.0)
    pdl_wait(USE_PDL)
    newest = valid & (n == ctx - 1)
    k = k.to(tl.float32) + tl.load(kc_ptr + off, mask=newest[:, None], other=0.0).to(tl.float32)
    v = v.to(tl.float32) + tl.load(vc_ptr + off, mask=newest[:, None], other=0.0).to(tl.float32)
    q = tl.load(q_ptr + (b * NH + h) * HD + d).to(tl.float32) * scale
    m_i, l_i, acc = softmax_tile(q, k, v, valid, tl.full([], -float("inf"), tl.float32), tl.full([], 0.0, tl.float32),
                                 tl.zeros([HD], dtype=tl.float32))
    m_i, l_i, acc = attend_tiles(q, kc_ptr, vc_ptr, bt_row, start + BLOCK_N, end, kvh, m_i, l_i, acc, NKV, HD,
                                 PAGE, BLOCK_N, "")
    wrote = 0
    if SPLITS == 1:
        o = acc / tl.maximum(l_i, 1e-30)
        tl.store(out_ptr + (b * NH + h) * HD + d, o.to(out_ptr.dtype.element_ty))
        wrote = 1
    elif FUSED_MERGE:
        # the last split of this (row, head) to finish merges them: no second kernel. Only the
        # splits whose span holds positions take part (a short context leaves the rest empty):
        # they store their partials, count themselves, and the last one merges just those.
        # Barrier, then a release/acquire count at GPU scope (cumulative: the partials of every
        # thread of every split are visible to the merging program), reads past L1.
        n_act = tl.maximum(tl.cdiv(ctx, tl.maximum(per_split, 1)), 1)
        if s < n_act:
            idx = (b * NH + h) * SPLITS + s
            tl.store(po_ptr + idx * HD + d, acc)
            tl.store(pm_ptr + idx, m_i)
            tl.store(pl_ptr + idx, l_i)
            tl.debug_barrier()
            bh = b * NH + h
            done = tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel", scope="gpu")
            if done == n_act - 1:
                tl.debug_barrier()
                merge_one(po_ptr, pm_ptr, pl_ptr, out_ptr, bh, n_act, HD, SPLITS, ".cg")
                tl.atomic_xchg(cnt_ptr + bh, 0, sem="relaxed", scope="gpu")  # ready for the next step
                wrote = 1
    else:
        idx = (b * NH + h) * SPLITS + s
        tl.store(po_ptr + idx * HD + d, acc)
        tl.store(pm_ptr + idx, m_i)
        tl.store(pl_ptr + idx, l_i)
    return wrote


@triton.jit
def merge_one(po_ptr, pm_ptr, pl_ptr, out_ptr, bh, n_act, HD: tl.constexpr, SPLITS: tl.constexpr,
              CACHE: tl.constexpr):
    """Merge the first `n_act` of the SPLITS partial softmaxes of one (row, head) into its output."""
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, HD)
    act = sp < n_act
    m = tl.load(pm_ptr + bh * SPLITS + sp, mask=act, other=-float("inf"), cache_modifier=CACHE)
    lsum = tl.load(pl_ptr + bh * SPLITS + sp, mask=act, other=0.0, cache_modifier=CACHE)
    mmax = tl.max(m, 0)
    mmax = tl.where(mmax == -float("inf"), 0.0, mmax)
    w = tl.exp(m - mmax)
    total = tl.sum(w * lsum, 0)
    po = tl.load(po_ptr + (bh * SPLITS + sp[:, None]) * HD + d[None, :], mask=act[:, None], other=0.0,
                 cache_modifier=CACHE)
    o = tl.sum(po * w[:, None], 0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + bh * HD + d, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_splits_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, HD: tl.constexpr, SPLITS: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    bh = tl.program_id(0)
    pdl_wait(USE_PDL)
    merge_one(po_ptr, pm_ptr, pl_ptr, out_ptr, bh, SPLITS, HD, SPLITS, "")


def choose_splits(batch: int, nh: int, num_sms: int = 132) -> int:
    """Splits per head so that batch·heads·splits roughly fills the GPU twice over (power of 2, ≤ 16)."""
    want = max(1, (2 * num_sms) // max(1, batch * nh))
    return min(16, triton.next_power_of_2(want) if want > 1 else 1)


def short_ctx_default(hd: int) -> int:
    """Longest context the one-program path takes (`paged_decode_attention(short_ctx=...)`): a
    [short, hd] K tile and its V tile of 16-bit values, 64 KiB together (256 positions at hd 64)."""
    return max(16, 16384 // hd)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, ctx_lens: torch.Tensor, page: int, scale: float,
                           splits: int, block_n: int = 64, pdl: bool | int = False,
                           counters: torch.Tensor | None = None, short_ctx: int | None = None) -> torch.Tensor:
    """One query per sequence over its paged context. q [B, nh, hd]; caches [slots, nkv, hd].
    pdl: launch with Programmatic Dependent Launch (Hopper+; see `decode_fused.py`).
    counters: int32 zeros, ≥ B·nh of them, kept between calls: with splits > 1 the last split of
    each head merges the partials itself (one kernel instead of two) and resets its counter; only
    the splits whose span holds positions take part.
    short_ctx (with counters only; None: `short_ctx_default(hd)`, 0: off, else a power of two):
    a row whose context is at most this long is done by one program per head, every position but
    the newest loaded before the PDL wait, without partials or merge. The kernel runs 4 warps: 8 made
    the split path slower on the H200 (docs/engine-decode.md)."""
    b, nh, hd = q.shape
    nkv = k_cache.shape[1]
    out = torch.empty_like(q)
    launch: dict[str, bool] = {"launch_pdl": True} if pdl else {}
    if splits > 1:
        po = torch.empty(b * nh * splits, hd, dtype=torch.float32, device=q.device)
        pm = torch.empty(b * nh * splits, dtype=torch.float32, device=q.device)
        pl = torch.empty(b * nh * splits, dtype=torch.float32, device=q.device)
    else:
        po = pm = pl = out
    fused = splits > 1 and counters is not None
    if counters is not None and fused and (counters.dtype != torch.int32 or counters.numel() < b * nh):
        raise ValueError(f"counters must be int32 with at least {b * nh} elements")
    short = (short_ctx_default(hd) if short_ctx is None else short_ctx) if fused else 0
    if short and (short < 16 or short & (short - 1)):
        raise ValueError(f"short_ctx must be 0 or a power of two ≥ 16, not {short}")
    _paged_decode_kernel[(b, nh, splits)](
        q, k_cache, v_cache, block_tables, ctx_lens, out, po, pm, pl, counters if fused else out,
        block_tables.stride(0), scale,
        NH=nh, NKV=nkv, GROUP=nh // nkv, HD=hd, PAGE=page, BLOCK_N=block_n, SPLITS=splits, USE_PDL=pdl_mode(pdl),
        FUSED_MERGE=fused, SHORT=short, num_warps=4, **launch,
    )
    if splits > 1 and not fused:
        _merge_splits_kernel[(b * nh,)](po, pm, pl, out, HD=hd, SPLITS=splits, USE_PDL=pdl_mode(pdl), **launch)
    return out
