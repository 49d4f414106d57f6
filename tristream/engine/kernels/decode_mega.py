"""A persistent batch-1 decode "megakernel" for small Llama models (prototype, not on the serving path).

A batch-1 decode step of SmolLM2-135M as a CUDA graph of 153 small kernels takes 0.48 ms on an
H200, ~3.1 µs per kernel: bound by launches and first round trips, not by its 0.064 ms of HBM
bytes. Here the whole step is ONE launch of `num_programs` = SM-count programs (all resident at
once). Each layer runs five phases — (1) RMSNorm + QKV GEMV + RoPE + K/V store + q to scratch,
(2) paged attention (a q head, or a split of it, per program; online softmax), (3) o-proj + residual, (4) RMSNorm
+ gate|up + SiLU·up, (5) down + residual — then the final norm + lm_head. Phases are separated
by grid-wide barriers on an int32 counter in global memory (arrive with a release/acquire atomic
add, spin until it reaches `(barrier + 1) · num_programs`); before waiting, each program loads
the first weight tile of its work in the next phase (constant weights), which overlaps the
barrier's latency with the next phase's first memory round trip. The last program to finish
resets the counters, so the launch can be replayed from a CUDA graph.

`ONE_PHASE=True` runs one phase per launch and no barrier: the same code runs in the Triton
interpreter (which executes programs one after another — a grid barrier would deadlock there)
and serves as a multi-launch fallback. The persistent path itself also runs in the interpreter
with a grid of one program (each barrier opens at that program's own arrival). Rounding follows
`decode_fused.decode_logits_b1`.

Status: measured nowhere yet (written without a GPU; compiled ahead of time for sm90: ~254
registers at 8 warps, no spills, one program per SM). `bench/decode_mega.py` measures it.

Limits (refused with `UnsupportedMegaShape`): batch 1 only; power-of-two head_dim; one KV-cache
dtype equal to the weights'; a grid no larger than what can be co-resident (checked against the
compiled kernel's registers and shared memory on CUDA). Attention splits the context over
`attn_splits` programs per q head (1 by default: one program walks it all); the last split of a
head to finish merges the partials, inside the same phase.
"""

from __future__ import annotations

import os
from typing import Any

import torch
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

SPIN_MODES = {"atomic": 0, "volatile": 1}
"""How a program waits at a grid barrier: 'atomic' polls with acquire atomics (formally ordered);
'volatile' polls with volatile loads, then one `fence.acq_rel.gpu` (as cooperative groups'
grid.sync does), cheaper polls at L2."""


class UnsupportedMegaShape(ValueError):
    """The megakernel does not handle this model, input or grid; use `decode_logits_b1` instead."""


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
def _mega_kernel(tab, L, emb, ids_ptr, pos_ptr, slot_ptr, bt_ptr, ctx_ptr, cs_ptr, fnorm, head_w,
                 rbuf, qbuf, abuf, act, logits, po, pm, pl, cnt, eps, scale, V, phase_layer, phase_kind,
                 H: tl.constexpr, NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, INTER: tl.constexpr,
                 PAGE: tl.constexpr, HAS_BIAS: tl.constexpr, PAIR: tl.constexpr, BK_QKV: tl.constexpr,
                 BN_O: tl.constexpr, BK_O: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr,
                 BN_D: tl.constexpr, BK_D: tl.constexpr, BN_H: tl.constexpr, BK_H: tl.constexpr,
                 ATT_BLOCK: tl.constexpr, ATT_SPLITS: tl.constexpr, ONE_PHASE: tl.constexpr, SPIN: tl.constexpr):
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
            w0 = _pre_rows(pid, wo, H, Q, BN_O, BK_O)
            phase_rows(pid, nprog, wo, H, abuf, rbuf, Q, eps, w0, rbuf, rbuf, False, True, BN_O, BK_O)
        elif phase_kind == 3:
            wgu = layer_ptr(tab, 3, layer, L, rbuf)
            wg0, wu0 = _pre_gu(pid, wgu, INTER, H, BN_GU, BK_GU)
            phase_gate_up(pid, nprog, wgu, INTER, rbuf, layer_ptr(tab, 6, layer, L, rbuf), H, eps, wg0, wu0, act,
                          BN_GU, BK_GU)
        elif phase_kind == 4:
            wd = layer_ptr(tab, 4, layer, L, rbuf)
            w0 = _pre_rows(pid, wd, H, INTER, BN_D, BK_D)
            phase_rows(pid, nprog, wd, H, act, rbuf, INTER, eps, w0, rbuf, rbuf, False, True, BN_D, BK_D)
        else:
            w0 = _pre_rows(pid, head_w, V, H, BN_H, BK_H)
            phase_rows(pid, nprog, head_w, V, rbuf, fnorm, H, eps, w0, rbuf, logits, True, False, BN_H, BK_H)
    else:
        w1, w2 = _pre_qkv(pid, tab, L, 0, rbuf, H, NH, NKV, HD, PAIR, BK_QKV)
        for layer in range(L):
            b0 = layer * 5
            _run_qkv(pid, nprog, tab, L, layer, emb_row, rbuf, qbuf, pos_ptr, cs_ptr, slot_ptr, eps, w1, w2,
                     H, NH, NKV, HD, PAIR, BK_QKV, HAS_BIAS)
            _grid_barrier(cnt, (b0 + 1) * nprog, SPIN)
            phase_attention(pid, nprog, tab, L, layer, rbuf, qbuf, abuf, bt_ptr, ctx_ptr, scale, po, pm, pl,
                            cnt + 2, NH, NKV, HD, PAGE, ATT_BLOCK, ATT_SPLITS)
            wo = layer_ptr(tab, 2, layer, L, rbuf)
            w0 = _pre_rows(pid, wo, H, Q, BN_O, BK_O)
            _grid_barrier(cnt, (b0 + 2) * nprog, SPIN)
            phase_rows(pid, nprog, wo, H, abuf, rbuf, Q, eps, w0, rbuf, rbuf, False, True, BN_O, BK_O)
            wgu = layer_ptr(tab, 3, layer, L, rbuf)
            wg0, wu0 = _pre_gu(pid, wgu, INTER, H, BN_GU, BK_GU)
            _grid_barrier(cnt, (b0 + 3) * nprog, SPIN)
            phase_gate_up(pid, nprog, wgu, INTER, rbuf, layer_ptr(tab, 6, layer, L, rbuf), H, eps, wg0, wu0, act,
                          BN_GU, BK_GU)
            wd = layer_ptr(tab, 4, layer, L, rbuf)
            wd0 = _pre_rows(pid, wd, H, INTER, BN_D, BK_D)
            _grid_barrier(cnt, (b0 + 4) * nprog, SPIN)
            phase_rows(pid, nprog, wd, H, act, rbuf, INTER, eps, wd0, rbuf, rbuf, False, True, BN_D, BK_D)
            # the next layer's first QKV tiles (the last layer reloads its own: harmless, never used)
            w1, w2 = _pre_qkv(pid, tab, L, tl.minimum(layer + 1, L - 1), rbuf, H, NH, NKV, HD, PAIR, BK_QKV)
            _grid_barrier(cnt, (b0 + 5) * nprog, SPIN)
        wh0 = _pre_rows(pid, head_w, V, H, BN_H, BK_H)
        phase_rows(pid, nprog, head_w, V, rbuf, fnorm, H, eps, wh0, rbuf, logits, True, False, BN_H, BK_H)
        # the last program out resets both counters for the next launch (graph replays)
        tl.debug_barrier()
        done = tl.atomic_add(cnt + 1, 1, sem="acq_rel", scope="gpu")
        if done == nprog - 1:
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(cnt + 1, 0, sem="relaxed", scope="gpu")


PHASES_PER_LAYER = 5


def _np2(x: int) -> int:
    return int(triton.next_power_of_2(max(1, x)))


def plan_tiles(cfg: Any, num_programs: int, tile_elems: int = 8192, attn_block: int = 64,
               max_block_k: int = 1024) -> dict[str, int]:
    """Per-phase tile constexprs: rows per work unit (as few rounds over the programs as a tile of
    at most `tile_elems` weight elements allows) and K columns per tile (≤ `max_block_k`, a power of 2)."""
    if max_block_k < 16 or max_block_k & (max_block_k - 1) or tile_elems < max_block_k:
        raise UnsupportedMegaShape(f"max_block_k ({max_block_k}) must be a power of two ≥ 16 and ≤ tile_elems "
                                   f"({tile_elems})")
    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    half = hd // 2
    heads = cfg.num_heads + 2 * cfg.num_kv_heads
    pair = min(half, _np2(-(-heads * half // num_programs)))
    bk_h = min(_np2(h), max_block_k)
    bk_q = min(_np2(cfg.q_size), max_block_k)
    bk_i = min(_np2(inter), max_block_k)

    def rows(n: int, bk: int) -> int:
        return max(1, min(_np2(-(-n // num_programs)), max(1, tile_elems // bk), 64))

    return {
        "PAIR": pair, "BK_QKV": min(bk_h, max(16, _np2(tile_elems // pair))),
        "BN_O": rows(h, bk_q), "BK_O": bk_q,
        "BN_GU": rows(inter, bk_h), "BK_GU": bk_h,
        "BN_D": rows(h, bk_i), "BK_D": bk_i,
        "BN_H": max(1, min(tile_elems // bk_h, 64)), "BK_H": bk_h,
        "ATT_BLOCK": attn_block,
    }


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class MegaDecoder:
    """One batch-1 decode step of a `LlamaModel` over a `KVCache` in one persistent launch (or, with
    `persistent=False`, one launch per phase). Weights and caches are addressed through int64
    pointer tables built here: keep the model's parameters and the cache alive and in place."""

    def __init__(self, model: Any, cache: Any, num_programs: int | None = None, num_warps: int = 8,
                 tile_elems: int = 8192, spin: str = "atomic", attn_block: int = 64, max_block_k: int = 1024,
                 attn_splits: int = 1) -> None:
        """num_programs: the grid (default: one program per SM; 4 on CPU for the interpreter);
        tile_elems / max_block_k / attn_block: tile sizes (`plan_tiles`); spin: `SPIN_MODES`;
        attn_splits: programs per q head in attention (power of 2; the last split of a head merges)."""
        cfg = model.cfg
        hd = cfg.head_dim
        if hd < 2 or hd & (hd - 1):
            raise UnsupportedMegaShape(f"head_dim must be a power of two, got {hd}")
        if spin not in SPIN_MODES:
            raise ValueError(f"spin must be one of {', '.join(SPIN_MODES)}, not {spin!r}")
        dev, dt = model.device, model.dtype
        if cache.k.dtype != dt or cache.k.device != dev:
            raise UnsupportedMegaShape(f"the KV cache ({cache.k.dtype}, {cache.k.device}) must match the weights "
                                       f"({dt}, {dev})")
        if dev.type == "cuda":
            props = torch.cuda.get_device_properties(dev)
            self.num_sms = int(props.multi_processor_count)
        else:
            self.num_sms = 4  # the interpreter runs programs one after another: keep the grid small
        self.num_programs = num_programs or self.num_sms
        if self.num_programs < 1:
            raise UnsupportedMegaShape(f"num_programs must be ≥ 1, got {self.num_programs}")
        self.model, self.cache, self.cfg = model, cache, cfg
        self.num_warps, self.spin = num_warps, SPIN_MODES[spin]
        layers = model.layers
        weights = []
        for i, layer in enumerate(layers):
            mats = (layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight)
            if any(m.dtype != dt or not m.is_contiguous() for m in mats):
                raise UnsupportedMegaShape(f"layer {i}: weights must be contiguous {dt} (no quantised layers)")
            kc, vc = cache.flat(i)
            bias = layer.qkv.bias if layer.qkv.bias is not None else layer.qkv.weight
            weights.append([layer.qkv.weight, bias, layer.o.weight, layer.gate_up.weight, layer.down.weight,
                            layer.input_norm, layer.post_norm, kc, vc])
        self.head_w = model.head().weight
        if self.head_w.dtype != dt or not self.head_w.is_contiguous():
            raise UnsupportedMegaShape(f"the lm_head must be a contiguous {dt} matrix")
        # table row r, column i: the address of layer i's r-th tensor (see decode_mega_phases)
        self.table = torch.tensor([[int(w[r].data_ptr()) for w in weights] for r in range(9)],
                                  dtype=torch.int64, device=dev)
        self._keep = weights  # the addresses stay valid while these tensors live
        h, q = cfg.hidden_size, cfg.q_size
        self.rbuf = torch.zeros(h, dtype=dt, device=dev)
        self.qbuf = torch.zeros(q, dtype=dt, device=dev)
        self.abuf = torch.zeros(q, dtype=dt, device=dev)
        self.act = torch.zeros(cfg.intermediate_size, dtype=dt, device=dev)
        self.logits = torch.zeros(1, cfg.vocab_size, dtype=torch.float32, device=dev)
        splits = attn_splits
        if splits < 1 or splits & (splits - 1) or splits > 64:
            raise UnsupportedMegaShape(f"attn_splits must be a power of two in 1..64, got {splits}")
        nh = cfg.num_heads
        self.po = torch.zeros(nh * splits, hd, dtype=torch.float32, device=dev)  # split partials
        self.pm = torch.zeros(nh * splits, dtype=torch.float32, device=dev)
        self.pl = torch.zeros(nh * splits, dtype=torch.float32, device=dev)
        # barrier arrivals, finished programs, then one finished-split count per q head
        self.counters = torch.zeros(2 + nh, dtype=torch.int32, device=dev)
        self.consts: dict[str, Any] = dict(
            H=h, NH=cfg.num_heads, NKV=cfg.num_kv_heads, HD=hd, INTER=cfg.intermediate_size,
            PAGE=cache.block_size, HAS_BIAS=layers[0].qkv.bias is not None,
            ATT_SPLITS=splits, **plan_tiles(cfg, self.num_programs, tile_elems, attn_block, max_block_k))
        self.kernel_info: dict[str, Any] | None = None

    def _args(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, bt: torch.Tensor,
              ctx_lens: torch.Tensor, layer: int, kind: int) -> tuple[Any, ...]:
        m, cfg = self.model, self.cfg
        return (self.table, cfg.num_layers, m.embed_tokens, ids, positions, slots, bt, ctx_lens, m.cos_sin, m.norm,
                self.head_w, self.rbuf, self.qbuf, self.abuf, self.act, self.logits, self.po, self.pm, self.pl,
                self.counters,
                cfg.rms_norm_eps, cfg.head_dim ** -0.5, cfg.vocab_size, layer, kind)

    def _check_batch1(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      block_tables: torch.Tensor, ctx_lens: torch.Tensor) -> torch.Tensor:
        for name, t in (("ids", ids), ("positions", positions), ("slots", slots), ("ctx_lens", ctx_lens)):
            if t.numel() != 1:
                raise UnsupportedMegaShape(f"the megakernel decodes batch 1: {name} has {t.numel()} elements "
                                           f"(slice the step buffers to [:1])")
        if block_tables.dim() == 2:
            if block_tables.shape[0] != 1:
                raise UnsupportedMegaShape(f"the megakernel decodes batch 1: block_tables has "
                                           f"{block_tables.shape[0]} rows")
            block_tables = block_tables[0]
        if not block_tables.is_contiguous():
            raise UnsupportedMegaShape("the block table row must be contiguous")
        return block_tables

    def check_coresident(self, args: tuple[Any, ...]) -> dict[str, Any]:
        """Compile the persistent kernel and refuse a grid that cannot be resident all at once (a grid
        barrier would then wait forever). Returns registers, spills, shared memory and the limit."""
        if self.kernel_info is not None:
            return self.kernel_info
        kw = dict(self.consts, ONE_PHASE=False, SPIN=self.spin, num_warps=self.num_warps, num_stages=1)
        props = torch.cuda.get_device_properties(self.model.device)
        threads = 32 * self.num_warps
        try:
            k = _mega_kernel.warmup(*args, grid=(self.num_programs,), **kw)
            k._init_handles()
            regs, spills = int(k.n_regs), int(k.n_spills)
            smem = int(getattr(k.metadata, "shared", 0))
        except AttributeError:  # a Triton without these internals: assume the worst (255 registers)
            regs, spills, smem = 255, -1, 0
        warp_regs = -(-regs * 32 // 256) * 256  # allocated per warp in units of 256
        per_sm = min(int(getattr(props, "regs_per_multiprocessor", 65536)) // max(1, warp_regs * self.num_warps),
                     int(getattr(props, "max_threads_per_multi_processor", 2048)) // threads,
                     int(getattr(props, "shared_memory_per_multiprocessor", 232448)) // smem if smem else 1 << 30)
        limit = per_sm * self.num_sms
        self.kernel_info = {"n_regs": regs, "n_spills": spills, "shared_bytes": smem,
                            "programs_per_sm": per_sm, "max_programs": limit, "num_programs": self.num_programs}
        if self.num_programs > limit:
            raise UnsupportedMegaShape(
                f"{self.num_programs} programs cannot all be resident ({per_sm}/SM x {self.num_sms} SMs at {regs} "
                f"registers, {smem} B shared, {self.num_warps} warps): pass num_programs <= {limit} or fewer warps")
        return self.kernel_info

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, persistent: bool = True) -> torch.Tensor:
        """Float32 logits [1, vocab] (a buffer reused by every call) of one step: token `ids[0]` at
        `positions[0]`, its K/V written to cache slot `slots[0]` (-1: not written), attention over
        `ctx_lens[0]` slots of `block_tables[0]`. All device tensors, so the call can be graphed."""
        bt = self._check_batch1(ids, positions, slots, block_tables, ctx_lens)
        grid = (self.num_programs,)
        if persistent:
            args = self._args(ids, positions, slots, bt, ctx_lens, 0, 0)
            if _interpreting() or self.model.device.type != "cuda":
                # the interpreter runs programs one after another: a barrier opens only for a single program
                if self.num_programs != 1 or self.spin != SPIN_MODES["atomic"]:
                    raise RuntimeError("the persistent megakernel needs a GPU for more than one program: the Triton "
                                       "interpreter runs programs one after another, so its grid barrier would "
                                       "never open; use persistent=False (or num_programs=1, spin='atomic')")
            else:
                self.check_coresident(args)
            _mega_kernel[grid](*args, **self.consts, ONE_PHASE=False, SPIN=self.spin, num_warps=self.num_warps,
                               num_stages=1)
            return self.logits
        for layer in range(self.cfg.num_layers):
            for kind in range(PHASES_PER_LAYER):
                _mega_kernel[grid](*self._args(ids, positions, slots, bt, ctx_lens, layer, kind), **self.consts,
                                   ONE_PHASE=True, SPIN=self.spin, num_warps=self.num_warps, num_stages=1)
        _mega_kernel[grid](*self._args(ids, positions, slots, bt, ctx_lens, 0, PHASES_PER_LAYER), **self.consts,
                           ONE_PHASE=True, SPIN=self.spin, num_warps=self.num_warps, num_stages=1)
        return self.logits

    def reset_counters(self) -> None:
        """Zero the barrier counters (after an aborted launch; a completed launch leaves them zero)."""
        self.counters.zero_()
