"""A persistent batch-1 decode "megakernel" for small Llama models (prototype, not on the serving path).

A batch-1 decode step of SmolLM2-135M as a CUDA graph of 153 small kernels takes 0.48 ms on an
H200, ~3.1 µs per kernel: bound by launches and first round trips, not by its 0.064 ms of HBM
bytes. Here the whole step is ONE launch of `num_programs` = SM-count programs (all resident at
once). Each layer runs five phases — (1) RMSNorm + QKV GEMV + RoPE + K/V store + q to scratch,
(2) paged attention (a q head, or a split of it, per program; online softmax), (3) o-proj +
residual, (4) RMSNorm + gate|up + SiLU·up, (5) down + residual — then the final norm + lm_head. Phases are separated
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

Files: this one (host wrapper `MegaDecoder`, tile plan), `decode_mega_kernel.py` (the kernel,
barriers, preloads), `decode_mega_phases.py` (the phases).

Status: correct on an H200 but slower than the production PDL chain (bench/results/decode_mega.json,
440dd6e): SmolLM2-135M 0.785 ms per step (0.696 with attention split over 8 programs) vs 0.475 ms
for `b1_pdl`; Llama-3.2-1B 1.84-1.96 vs 0.98 ms; greedy tokens agree. Per phase as program 0 saw
it (135M): QKV 2.9 µs, attention 10.1, o-proj 2.6, gate|up 5.1, down 3.6, lm_head 53.6 (13 µs of
bytes): every phase pays a grid barrier plus a first memory round trip (~2.5 µs), and the GEMV
phases keep too few bytes in flight per SM (one weight tile, no pipelining) to reach the HBM rate —
the 1B's lm_head phase takes 294 µs for 125 µs of bytes. Not on the serving path.

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

from tristream.engine.kernels.decode_mega_kernel import PHASES_PER_LAYER, SPIN_MODES, mega_decode_kernel


class UnsupportedMegaShape(ValueError):
    """The megakernel does not handle this model, input or grid; use `decode_logits_b1` instead."""


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
                 attn_splits: int = 1, timestamps: bool = False) -> None:
        """num_programs: the grid (default: one program per SM; 4 on CPU for the interpreter);
        tile_elems / max_block_k / attn_block: tile sizes (`plan_tiles`); spin: `SPIN_MODES`;
        attn_splits: programs per q head in attention (power of 2; the last split of a head merges);
        timestamps: the persistent kernel records when program 0 passes each barrier (`phase_times_us`)."""
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
        if timestamps and dev.type != "cuda":
            raise UnsupportedMegaShape("timestamps read GPU clocks: CUDA only")
        self.stamp = timestamps
        self.times = torch.zeros(2 * (PHASES_PER_LAYER * cfg.num_layers + 2), dtype=torch.int64, device=dev)
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
                self.counters, self.times,
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
        kw = dict(self.consts, ONE_PHASE=False, SPIN=self.spin, STAMP=self.stamp, num_warps=self.num_warps,
                  num_stages=1)
        props = torch.cuda.get_device_properties(self.model.device)
        threads = 32 * self.num_warps
        try:
            k = mega_decode_kernel.warmup(*args, grid=(self.num_programs,), **kw)
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
            mega_decode_kernel[grid](*args, **self.consts, ONE_PHASE=False, SPIN=self.spin, STAMP=self.stamp,
                               num_warps=self.num_warps,
                               num_stages=1)
            return self.logits
        for layer in range(self.cfg.num_layers):
            for kind in range(PHASES_PER_LAYER):
                mega_decode_kernel[grid](*self._args(ids, positions, slots, bt, ctx_lens, layer, kind), **self.consts,
                                   ONE_PHASE=True, SPIN=self.spin, STAMP=False, num_warps=self.num_warps, num_stages=1)
        mega_decode_kernel[grid](*self._args(ids, positions, slots, bt, ctx_lens, 0, PHASES_PER_LAYER), **self.consts,
                           ONE_PHASE=True, SPIN=self.spin, STAMP=False, num_warps=self.num_warps, num_stages=1)
        return self.logits

    def phase_times_us(self) -> dict[str, float]:
        """Microseconds per phase kind (mean over layers) of the last persistent launch with
        `timestamps=True`, as program 0 saw them: its work plus the wait for the slowest program and
        the barrier. Clock cycles converted through the global timer over the whole launch."""
        if not self.stamp:
            raise RuntimeError("construct the MegaDecoder with timestamps=True")
        n = self.times.numel() // 2
        t = self.times.cpu().to(torch.float64)
        clk, gt = t[:n], t[n:]
        ns_per_clk = float(gt[-1] - gt[0]) / max(1.0, float(clk[-1] - clk[0]))
        d = (clk[1:] - clk[:-1]) * ns_per_clk / 1e3
        per = d[: n - 2].view(self.cfg.num_layers, PHASES_PER_LAYER).mean(0).tolist()
        names = ("qkv_rope_store", "attention", "o_proj", "gate_up", "down")
        out = {k: round(v, 3) for k, v in zip(names, per, strict=True)}
        out["head"] = round(float(d[n - 2]), 3)
        out["total"] = round(float(gt[-1] - gt[0]) / 1e3, 3)
        return out

    def reset_counters(self) -> None:
        """Zero the barrier counters (after an aborted launch; a completed launch leaves them zero)."""
        self.counters.zero_()
