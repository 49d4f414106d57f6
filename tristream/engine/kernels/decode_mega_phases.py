"""The phases of the batch-1 decode megakernel (`decode_mega.py`), as Triton device functions.

Every phase spreads its work over the programs of the launch (`for unit in range(pid, n, nprog)`)
and reads the activations of the previous phase with ``.cg`` loads (L2, never a stale L1 line:
another SM wrote them). The GEMV phases take the first K tile of the program's first unit of
weights as an argument (`w0`): the persistent kernel loads it *before* waiting at the grid
barrier (weights are constant), which hides the first round trip to memory behind the wait.

Rounding follows `decode_fused.decode_logits_b1`: the normalised row is cast to the weight dtype
before the products, sums are float32, each projection's output is rounded to the weight dtype
(before the bias-free residual add, the rotation, SiLU), the logits are the rounded head output.

Pointer table rows (`tab`, int64 [ROWS, L], one column per layer): see `T_*` below.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tristream.engine.kernels.decode_fused import rope_store_pair
from tristream.engine.kernels.triton_ops import attend_span, merge_one

T_QKV, T_QKV_B, T_O, T_GU, T_DOWN, T_IN_NORM, T_POST_NORM, T_KC, T_VC = range(9)
TABLE_ROWS = 9


@triton.jit
def layer_ptr(tab, row: tl.constexpr, layer, L, like):
    """The pointer of table row `row` for `layer`, typed like the pointer `like`."""
    return tl.load(tab + row * L + layer).to(tl.pointer_type(like.dtype.element_ty))


@triton.jit
def row_rstd_cg(x, K, eps, BK: tl.constexpr):
    """1 / RMS of x[0:K] in float32 (``.cg`` loads)."""
    ss = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        xv = tl.load(x + rk, mask=rk < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        ss += xv * xv
    return tl.rsqrt(tl.sum(ss, 0) / K + eps)


@triton.jit
def first_tile(w, rows, N, K, BK: tl.constexpr):
    """The first K tile [len(rows), BK] of weight rows `rows` (rows ≥ N read as zeros)."""
    rk = tl.arange(0, BK)
    return tl.load(w + rows.to(tl.int64)[:, None] * K + rk[None, :], mask=(rows < N)[:, None] & (rk < K)[None, :],
                   other=0.0)


@triton.jit
def x_tile(x, nw, rk, K, rstd, NORM: tl.constexpr, dt: tl.constexpr):
    """Activation tile x[rk] (RMS-normalised with weight nw when NORM), in the weight dtype."""
    kmask = rk < K
    xv = tl.load(x + rk, mask=kmask, other=0.0, cache_modifier=".cg")
    if NORM:
        nv = tl.load(nw + rk, mask=kmask, other=0.0)
        xv = ((xv.to(tl.float32) * rstd).to(dt).to(tl.float32) * nv.to(tl.float32)).to(dt)
    return xv.to(dt)


@triton.jit
def dot_rows(w, rows, N, x, nw, K, rstd, w0, NORM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """float32 sums W[rows] · prologue(x) over K; `w0` is the first K tile of these rows."""
    dt = w.dtype.element_ty
    rmask = rows < N
    r64 = rows.to(tl.int64)
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        xv = x_tile(x, nw, rk, K, rstd, NORM, dt)
        if k0 == 0:
            wt = w0
        else:
            wt = tl.load(w + r64[:, None] * K + rk[None, :], mask=rmask[:, None] & (rk < K)[None, :], other=0.0)
        acc += tl.sum(wt.to(tl.float32) * xv.to(tl.float32)[None, :], 1)
    return acc


@triton.jit
def dot_pair(w, ra, rb, N, x, nw, K, rstd, wa0, wb0, NORM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """`dot_rows` for two row sets sharing one activation (RoPE partners, gate and up rows)."""
    dt = w.dtype.element_ty
    ma = ra < N
    mb = rb < N
    a64 = ra.to(tl.int64)
    b64 = rb.to(tl.int64)
    acc_a = tl.zeros([BN], dtype=tl.float32)
    acc_b = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        kmask = rk < K
        xv = x_tile(x, nw, rk, K, rstd, NORM, dt).to(tl.float32)
        if k0 == 0:
            wa = wa0
            wb = wb0
        else:
            wa = tl.load(w + a64[:, None] * K + rk[None, :], mask=ma[:, None] & kmask[None, :], other=0.0)
            wb = tl.load(w + b64[:, None] * K + rk[None, :], mask=mb[:, None] & kmask[None, :], other=0.0)
        acc_a += tl.sum(wa.to(tl.float32) * xv[None, :], 1)
        acc_b += tl.sum(wb.to(tl.float32) * xv[None, :], 1)
    return acc_a, acc_b


# ------------------------------------------------------------------ phase 1: norm + QKV + RoPE + store

@triton.jit
def qkv_rows(unit, HD: tl.constexpr, HALF: tl.constexpr, PAIR: tl.constexpr):
    """Weight rows (first-half rows, their rotation partners) of QKV work unit `unit`."""
    ns = HALF // PAIR
    r1 = (unit // ns) * HD + (unit % ns) * PAIR + tl.arange(0, PAIR)
    return r1, r1 + HALF


@triton.jit
def phase_qkv(pid, nprog, tab, L, layer, x, nw, rbuf, emb_row, qbuf, pos_ptr, cs_ptr, slot_ptr, eps, w1, w2,
              H, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, PAIR: tl.constexpr,
              BK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Units: (head, PAIR-row slice of its first half); q heads → qbuf, k/v heads → the caches."""
    HALF: tl.constexpr = HD // 2
    NROWS: tl.constexpr = (NH + 2 * NKV) * HD
    w = layer_ptr(tab, 0, layer, L, rbuf)
    kc = layer_ptr(tab, 7, layer, L, rbuf)
    vc = layer_ptr(tab, 8, layer, L, rbuf)
    dt = rbuf.dtype.element_ty
    if layer == 0:
        if pid == 0:  # the residual stream starts as the embedding row
            for k0 in range(0, H, BK):
                rk = k0 + tl.arange(0, BK)
                tl.store(rbuf + rk, tl.load(emb_row + rk, mask=rk < H, other=0.0), mask=rk < H)
    rstd = row_rstd_cg(x, H, eps, BK)
    n_units = (NH + 2 * NKV) * (HALF // PAIR)
    for unit in range(pid, n_units, nprog):
        r1, r2 = qkv_rows(unit, HD, HALF, PAIR)
        if unit != pid:  # not the unit whose first tile was preloaded
            w1 = first_tile(w, r1, NROWS, H, BK)
            w2 = first_tile(w, r2, NROWS, H, BK)
        acc1, acc2 = dot_pair(w, r1, r2, NROWS, x, nw, H, rstd, w1, w2, True, PAIR, BK)
        if HAS_BIAS:
            b = layer_ptr(tab, 1, layer, L, rbuf)
            acc1 += tl.load(b + r1).to(tl.float32)
            acc2 += tl.load(b + r2).to(tl.float32)
        x1 = acc1.to(dt).to(tl.float32)
        x2 = acc2.to(dt).to(tl.float32)
        h = unit // (HALF // PAIR)
        d1 = (unit % (HALF // PAIR)) * PAIR + tl.arange(0, PAIR)
        rope_store_pair(h, d1, x1, x2, pos_ptr, cs_ptr, slot_ptr, qbuf, kc, vc, NH, NKV, HD, HALF)


# ------------------------------------------------------------------ phase 2: paged attention

@triton.jit
def phase_attention(pid, nprog, tab, L, layer, rbuf, qbuf, abuf, bt_ptr, ctx_ptr, scale, po, pm, pl, hcnt,
                    NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """Units (q head, context split): online softmax over the split's part of the paged context (as
    `_paged_decode_kernel`). With SPLITS > 1 the partials go to po/pm/pl and the last split of a
    head to finish (a release/acquire count in `hcnt`) merges them into abuf and resets its count."""
    kc = layer_ptr(tab, 7, layer, L, rbuf)
    vc = layer_ptr(tab, 8, layer, L, rbuf)
    ctx = tl.load(ctx_ptr)
    d = tl.arange(0, HD)
    per_split = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    for unit in range(pid, NH * SPLITS, nprog):
        h = unit // SPLITS
        sp = unit % SPLITS
        start = sp * per_split
        end = tl.minimum(start + per_split, ctx)
        kvh = h // (NH // NKV)
        q = tl.load(qbuf + h * HD + d, cache_modifier=".cg").to(tl.float32) * scale
        m_i, l_i, acc = attend_span(q, kc, vc, bt_ptr, start, end, kvh, NKV, HD, PAGE, BLOCK_N, ".cg")
        if SPLITS == 1:
            tl.store(abuf + h * HD + d, (acc / tl.maximum(l_i, 1e-30)).to(abuf.dtype.element_ty))
        else:
            tl.store(po + unit * HD + d, acc)
            tl.store(pm + unit, m_i)
            tl.store(pl + unit, l_i)
            tl.debug_barrier()
            done = tl.atomic_add(hcnt + h, 1, sem="acq_rel", scope="gpu")
            if done == SPLITS - 1:
                tl.debug_barrier()
                merge_one(po, pm, pl, abuf, h, SPLITS, HD, SPLITS, ".cg")  # other SMs wrote them
                tl.atomic_xchg(hcnt + h, 0, sem="relaxed", scope="gpu")


# ------------------------------------------------------------------ GEMV phases

@triton.jit
def phase_rows(pid, nprog, w, N, x, nw, K, eps, w0, res, out, NORM: tl.constexpr, RES: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr):
    """out[rows] = round(W[rows] · prologue(x)) (+ res[rows], rounded) over BN-row tiles; `out`'s
    dtype decides the stored type (float32 logits hold the rounded head output)."""
    dt = w.dtype.element_ty
    if NORM:
        rstd = row_rstd_cg(x, K, eps, BK)
    else:
        rstd = 1.0
    for t in range(pid, tl.cdiv(N, BN), nprog):
        rows = t * BN + tl.arange(0, BN)
        if t != pid:
            w0 = first_tile(w, rows, N, K, BK)
        y = dot_rows(w, rows, N, x, nw, K, rstd, w0, NORM, BN, BK).to(dt)
        if RES:
            r = tl.load(res + rows, mask=rows < N, other=0.0, cache_modifier=".cg")
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(out + rows, y.to(out.dtype.element_ty), mask=rows < N)


@triton.jit
def phase_gate_up(pid, nprog, w, INTER, x, nw, K, eps, wg0, wu0, act, BN: tl.constexpr, BK: tl.constexpr):
    """act[i] = silu(gate_i) · up_i for BN-row tiles; gate row i is paired with up row INTER + i."""
    dt = w.dtype.element_ty
    rstd = row_rstd_cg(x, K, eps, BK)
    for t in range(pid, tl.cdiv(INTER, BN), nprog):
        rows = t * BN + tl.arange(0, BN)
        rmask = rows < INTER
        rows_u = tl.where(rmask, rows + INTER, 2 * INTER)  # out of range → masked
        if t != pid:
            wg0 = first_tile(w, rows, INTER, K, BK)
            wu0 = first_tile(w, rows_u, 2 * INTER, K, BK)
        g, u = dot_pair(w, rows, rows_u, 2 * INTER, x, nw, K, rstd, wg0, wu0, True, BN, BK)
        g = g.to(dt).to(tl.float32)
        u = u.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(act + rows, (s * u).to(dt), mask=rmask)
