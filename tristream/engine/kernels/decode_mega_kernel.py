"""The persistent batch-1 decode kernel of `decode_mega.py`: grid barriers, first-tile preloads,
timestamps, and `mega_decode_kernel` (all phases of a step in one launch, or one phase per launch).

See `decode_mega.py` for the design and the host wrapper `MegaDecoder`; the phases themselves are in
`decode_mega_phases.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tristream.engine.kernels.decode_mega_phases import (
    first_tile,
    layer_ptr,
    phase_attention,
    phase_gate_up,
    phase_qkv,
    phase_rows,
    qkv_rows,
)

PHASES_PER_LAYER = 5
"""qkv+rope+store, attention, o-proj, gate_up, down; then the head (phase kind 5)."""

SPIN_MODES = {"atomic": 0, "volatile": 1}
"""How a program waits at a grid barrier: 'atomic' polls with acquire atomics (formally ordered);
'volatile' polls with volatile loads, then one `fence.acq_rel.gpu` (as cooperative groups'
grid.sync does), cheaper polls at L2."""


@triton.jit
def _grid_barrier(cnt, target, SPIN: tl.constexpr):
    """Wait until `target` arrivals (all programs, this barrier included) were counted."""
    tl.debug_barrier()  # every thread's stores of this phase precede the release below
    c = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") + 1
    if SPIN == 0:
        while c < target:
            c = tl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
    else:
        while c < target:
            c = tl.load(cnt, volatile=True)
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)
    tl.debug_barrier()


@triton.jit
def _stamp(times, idx, pid, n_stamps, STAMP: tl.constexpr):
    """Program 0 records %clock64 and %globaltimer at stamp `idx` (GPU only; nothing unless STAMP)."""
    if STAMP:
        if pid == 0:
            clk = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
            gt = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                           pack=1)
            tl.store(times + idx, clk)
            tl.store(times + n_stamps + idx, gt)


@triton.jit
def _pre_qkv(pid, tab, L, layer, like, H, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
             PAIR: tl.constexpr, BK: tl.constexpr):
    w = layer_ptr(tab, 0, layer, L, like)
    r1, r2 = qkv_rows(pid, HD, HD // 2, PAIR)
    n = (NH + 2 * NKV) * HD
    return first_tile(w, r1, n, H, BK), first_tile(w, r2, n, H, BK)


@triton.jit
def _run_qkv(pid, nprog, tab, L, layer, emb_row, rbuf, qbuf, pos_ptr, cs_ptr, slot_ptr, eps, w1, w2,
             H, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, PAIR: tl.constexpr, BK: tl.constexpr,
             HAS_BIAS: tl.constexpr):
    nw = layer_ptr(tab, 5, layer, L, rbuf)
    if layer == 0:
        x = emb_row
    else:
        x = rbuf
    phase_qkv(pid, nprog, tab, L, layer, x, nw, rbuf, emb_row, qbuf, pos_ptr, cs_ptr, slot_ptr, eps, w1, w2,
              H, NH, NKV, HD, PAIR, BK, HAS_BIAS)


@triton.jit
def _pre_gu(pid, w, INTER, K, BN: tl.constexpr, BK: tl.constexpr):
    rows = pid * BN + tl.arange(0, BN)
    rows_u = tl.where(rows < INTER, rows + INTER, 2 * INTER)
    return first_tile(w, rows, INTER, K, BK), first_tile(w, rows_u, 2 * INTER, K, BK)


@triton.jit
def _pre_rows(pid, w, N, K, BN: tl.constexpr, BK: tl.constexpr):
    return first_tile(w, pid * BN + tl.arange(0, BN), N, K, BK)


@triton.jit(do_not_specialize=["L", "V", "phase_layer", "phase_kind"])  # one compile for every phase
def mega_decode_kernel(tab, L, emb, ids_ptr, pos_ptr, slot_ptr, bt_ptr, ctx_ptr, cs_ptr, fnorm, head_w,
                 rbuf, qbuf, abuf, act, logits, po, pm, pl, cnt, times, eps, scale, V, phase_layer, phase_kind,
                 H: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, INTER: tl.constexpr,
                 PAGE: tl.constexpr, HAS_BIAS: tl.constexpr, PAIR: tl.constexpr, BK_QKV: tl.constexpr,
                 BN_O: tl.constexpr, BK_O: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr,
                 BN_D: tl.constexpr, BK_D: tl.constexpr, BN_H: tl.constexpr, BK_H: tl.constexpr,
                 ATT_BLOCK: tl.constexpr, ATT_SPLITS: tl.constexpr, ONE_PHASE: tl.constexpr, SPIN: tl.constexpr,
                 STAMP: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    Q: tl.constexpr = NH * HD
    emb_row = emb + tl.load(ids_ptr).to(tl.int64) * H
    if ONE_PHASE:
        layer = phase_layer
        if phase_kind == 0:
            w1, w2 = _pre_qkv(pid, tab, L, layer, rbuf, H, NH, NKV, HD, PAIR, BK_QKV)
            _run_qkv(pid, nprog, tab, L, layer, emb_row, rbuf, qbuf, pos_ptr, cs_ptr, slot_ptr, eps, w1, w2,
                     H, NH, NKV, HD, PAIR, BK_QKV, HAS_BIAS)
        elif phase_kind == 1:
            phase_attention(pid, nprog, tab, L, layer, rbuf, qbuf, abuf, bt_ptr, ctx_ptr, scale, po, pm, pl,
                            cnt + 2, NH, NKV, HD, PAGE, ATT_BLOCK, ATT_SPLITS)
        elif phase_kind == 2:
            wo = layer_ptr(tab, 2, layer, L, rbuf)
            wo0 = _pre_rows(pid, wo, H, Q, BN_O, BK_O)  # one name per tile shape: Triton types a
            phase_rows(pid, nprog, wo, H, abuf, rbuf, Q, eps, wo0, rbuf, rbuf, False, True, BN_O, BK_O)  # name once
        elif phase_kind == 3:
            wgu = layer_ptr(tab, 3, layer, L, rbuf)
            wg0, wu0 = _pre_gu(pid, wgu, INTER, H, BN_GU, BK_GU)
            phase_gate_up(pid, nprog, wgu, INTER, rbuf, layer_ptr(tab, 6, layer, L, rbuf), H, eps, wg0, wu0, act,
                          BN_GU, BK_GU)
        elif phase_kind == 4:
            wd = layer_ptr(tab, 4, layer, L, rbuf)
            wd0 = _pre_rows(pid, wd, H, INTER, BN_D, BK_D)
            phase_rows(pid, nprog, wd, H, act, rbuf, INTER, eps, wd0, rbuf, rbuf, False, True, BN_D, BK_D)
        else:
            wh0 = _pre_rows(pid, head_w, V, H, BN_H, BK_H)
            phase_rows(pid, nprog, head_w, V, rbuf, fnorm, H, eps, wh0, rbuf, logits, True, False, BN_H, BK_H)
    else:
        n_stamps = 5 * L + 2
        _stamp(times, 0, pid, n_stamps, STAMP)
        w1, w2 = _pre_qkv(pid, tab, L, 0, rbuf, H, NH, NKV, HD, PAIR, BK_QKV)
        for layer in range(L):
            b0 = layer * 5
            _run_qkv(pid, nprog, tab, L, layer, emb_row, rbuf, qbuf, pos_ptr, cs_ptr, slot_ptr, eps, w1, w2,
                     H, NH, NKV, HD, PAIR, BK_QKV, HAS_BIAS)
            _grid_barrier(cnt, (b0 + 1) * nprog, SPIN)
            _stamp(times, b0 + 1, pid, n_stamps, STAMP)
            phase_attention(pid, nprog, tab, L, layer, rbuf, qbuf, abuf, bt_ptr, ctx_ptr, scale, po, pm, pl,
                            cnt + 2, NH, NKV, HD, PAGE, ATT_BLOCK, ATT_SPLITS)
            wo = layer_ptr(tab, 2, layer, L, rbuf)
            w0 = _pre_rows(pid, wo, H, Q, BN_O, BK_O)
            _grid_barrier(cnt, (b0 + 2) * nprog, SPIN)
            _stamp(times, b0 + 2, pid, n_stamps, STAMP)
            phase_rows(pid, nprog, wo, H, abuf, rbuf, Q, eps, w0, rbuf, rbuf, False, True, BN_O, BK_O)
            wgu = layer_ptr(tab, 3, layer, L, rbuf)
            wg0, wu0 = _pre_gu(pid, wgu, INTER, H, BN_GU, BK_GU)
            _grid_barrier(cnt, (b0 + 3) * nprog, SPIN)
            _stamp(times, b0 + 3, pid, n_stamps, STAMP)
            phase_gate_up(pid, nprog, wgu, INTER, rbuf, layer_ptr(tab, 6, layer, L, rbuf), H, eps, wg0, wu0, act,
                          BN_GU, BK_GU)
            wd = layer_ptr(tab, 4, layer, L, rbuf)
            wd0 = _pre_rows(pid, wd, H, INTER, BN_D, BK_D)
            _grid_barrier(cnt, (b0 + 4) * nprog, SPIN)
            _stamp(times, b0 + 4, pid, n_stamps, STAMP)
            phase_rows(pid, nprog, wd, H, act, rbuf, INTER, eps, wd0, rbuf, rbuf, False, True, BN_D, BK_D)
            # the next layer's first QKV tiles (the last layer reloads its own: harmless, never used)
            w1, w2 = _pre_qkv(pid, tab, L, tl.minimum(layer + 1, L - 1), rbuf, H, NH, NKV, HD, PAIR, BK_QKV)
            _grid_barrier(cnt, (b0 + 5) * nprog, SPIN)
            _stamp(times, b0 + 5, pid, n_stamps, STAMP)
        wh0 = _pre_rows(pid, head_w, V, H, BN_H, BK_H)
        phase_rows(pid, nprog, head_w, V, rbuf, fnorm, H, eps, wh0, rbuf, logits, True, False, BN_H, BK_H)
        _stamp(times, n_stamps - 1, pid, n_stamps, STAMP)
        # the last program out resets both counters for the next launch (graph replays)
        tl.debug_barrier()
        done = tl.atomic_add(cnt + 1, 1, sem="acq_rel", scope="gpu")
        if done == nprog - 1:
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(cnt + 1, 0, sem="relaxed", scope="gpu")

