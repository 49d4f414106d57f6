"""GPU decode: Triton paged attention and CUDA graphs captured per batch-size bucket.

All inputs of a decode step (token ids, a flag word, positions, cache slots, context lengths, block
tables) live in one persistent int32 device buffer, filled from one pinned host buffer by a single
copy; every graph reads slices of it. Graphs are captured at start-up, largest bucket first,
into one shared memory pool; a batch of n sequences replays the smallest bucket ≥ n with the
padded rows pointing at slot -1 (no cache write) and context length 0 (zero output). Batches
larger than the largest bucket, or `use_graphs=False`, run the same kernels eagerly.

Each graph starts by advancing its inputs on the device (`kernels/advance.py`): a replay that no
host copy preceded feeds every live row the position after its last one, so that steady decode of
an unchanged batch copies nothing to the device (`decode_chain.ChainedDecode` copies only when the
batch or a block table changes; `prepare` always copies). Each graph ends with the greedy tokens of
its rows (`kernels/argmax.GraphArgmax`, on the head's logits in the model dtype): into `tokens[b]`,
into the input ids (a chained step of the same bucket copies no ids) and into mapped pinned host
memory (`mapped_tokens`: nothing to copy back either). A replay therefore leaves the next step's ids
in place and the replayed step's ids are gone (`prepare` writes them again). The graph keeps the
head's logits as computed; `run` returns a float32 copy made outside the graph. Replays must go
through `graphs[b].replay()` (`_DecodeGraph`), which keeps the host's mirror of that state.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from tristream.engine.decode_inputs import FRESH, HOLD, InputState
from tristream.engine.kernel_choice import B1_VARIANTS, CAPTURE_PDL, CAPTURE_PLAIN, VARIANTS, variant_agrees
from tristream.engine.kernels import triton_ops as K
from tristream.engine.kernels.advance import advance_embed
from tristream.engine.kernels.argmax import GraphArgmax
from tristream.engine.kernels.decode_fused import TILES, decode_logits_b1
from tristream.engine.kv_cache import KVCache
from tristream.engine.models.llama import LlamaModel
from tristream.engine.sampler import greedy_tokens
from tristream.engine.sequence import Sequence

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class TritonOps:
    """Fused elementwise kernels for the decode step."""

    rms_norm = staticmethod(K.rms_norm)
    add_rms_norm = staticmethod(K.add_rms_norm)
    silu_mul = staticmethod(K.silu_mul)


class TritonDecodeAttention:
    """Attention backend for one-token-per-sequence decode over the paged cache."""

    def __init__(self, model: LlamaModel, cache: KVCache, positions: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, ctx_lens: torch.Tensor, splits: int,
                 counters: torch.Tensor | None = None) -> None:
        """counters: persistent int32 zeros (one per row and head) that let the batch-1 path merge
        split attention in the same kernel (`decode_fused.decode_logits_b1`)."""
        self.cfg = model.cfg
        self.cos_sin = model.cos_sin
        self.cache = cache
        self.positions, self.slots, self.block_tables, self.ctx_lens = positions, slots, block_tables, ctx_lens
        self.splits = splits
        self.counters = counters
        self.scale = self.cfg.head_dim ** -0.5

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        kc, vc = self.cache.flat(layer)
        q = K.rope_store(qkv, self.positions, self.cos_sin, self.slots, kc, vc,
                         cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        o = K.paged_decode_attention(q, kc, vc, self.block_tables, self.ctx_lens, self.cache.block_size,
                                     self.scale, self.splits)
        return o.view(q.shape[0], cfg.q_size)


def b1_options(variant: str) -> dict[str, Any]:
    """A batch-1 variant name → the keyword arguments of `decode_fused.decode_logits_b1`."""
    if variant not in B1_VARIANTS:
        raise ValueError(f"unknown batch-1 variant {variant!r}")
    name = variant
    hc = name.endswith("_hc")
    name = name.removesuffix("_hc")
    ln = name.endswith("_ln")
    name = name.removesuffix("_ln")
    pdl = 2 if name.endswith("_pdle") else 1 if name.endswith("_pdl") else 0
    name = name.removesuffix("_pdle").removesuffix("_pdl")
    tile, warps = TILES[name]
    return {"pdl": pdl, "tile": tile, "num_warps": warps, "head_cublas": hc, "late_norm": ln}


class DecodeGraphs:
    """Persistent decode inputs and one CUDA graph per batch bucket."""

    def __init__(self, model: LlamaModel, cache: KVCache, max_model_len: int,
                 buckets: tuple[int, ...] | None = None, use_graphs: bool = True,
                 kernels: str = "auto") -> None:
        """kernels: 'cublas', one of the batch-1 variants `B1_VARIANTS` (bucket 1 through the fused
        norm+QKV+RoPE+store layer and GEMVs, launched without / with Programmatic Dependent Launch;
        larger buckets through cuBLAS), or 'auto' (time the batch-1 variants at capture, keep the
        fastest that agrees with cuBLAS)."""
        if kernels != "auto" and kernels not in VARIANTS:
            raise ValueError(f"kernels must be auto or one of {', '.join(VARIANTS)}, not {kernels!r}")
        self.kernels = kernels
        self.chosen: dict[int, str] = {}  # bucket -> the variant chosen at capture (bucket 1)
        self.choice_ms: dict[int, dict[str, float]] = {}
        self.variant_errors: list[str] = []  # every variant rejected at capture, and why
        self.choice_err: dict[int, dict[str, float]] = {}  # bucket -> variant -> logits rel err vs cuBLAS
        self.model = model
        self.cache = cache
        self.buckets = tuple(sorted(buckets or DEFAULT_BUCKETS))
        self.max_bs = self.buckets[-1]
        self.max_blocks = -(-max_model_len // cache.block_size)
        self.use_graphs = use_graphs
        n = self.max_bs
        # the buffer's layout: ids [n], flag [1] (kernels/advance.py), positions, slots, context lengths [n each],
        # block tables [n, max_blocks]; a step copies [0 or o_flag, o_bt + rows * max_blocks)
        self.o_flag = n
        self.o_pos = n + 1
        self.o_slot = 2 * n + 1
        self.o_ctx = 3 * n + 1
        self.o_bt = 4 * n + 1
        self._size = self.o_bt + n * self.max_blocks
        dev = model.device
        self.dev_buf = torch.zeros(self._size, dtype=torch.int32, device=dev)
        self.dev_buf[self.o_flag] = HOLD
        self.host_buf = torch.zeros(self._size, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self.host_np = self.host_buf.numpy()
        self.ids = self.dev_buf[0:n]
        self.positions = self.dev_buf[self.o_pos:self.o_pos + n]
        self.slots = self.dev_buf[self.o_slot:self.o_slot + n]
        self.ctx_lens = self.dev_buf[self.o_ctx:self.o_ctx + n]
        self.block_tables = self.dev_buf[self.o_bt:].view(n, self.max_blocks)
        # the host's mirror of the inputs a replay computes with: (bucket, seq ids, cache indexes, block
        # table lengths) of the last replay (None: unknown, e.g. after an eager step or a held replay),
        # and of the copy queued for the next one
        self.on_device: InputState | None = None
        self.pending: InputState | None = None
        self.uploads = 0  # host→device input copies (prepare, chained steps that could not advance)
        self.ids_hint: tuple[int, ...] | None = None  # the ids the last replay left, as read back (run_greedy_host)
        self._done = torch.cuda.Event() if dev.type == "cuda" else None
        self.merge_counters = torch.zeros(n * model.cfg.num_heads, dtype=torch.int32, device=dev)
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
        self.graphs: dict[int, _DecodeGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, torch.Tensor] = {}  # bucket -> the greedy tokens its graph computes (int64)
        self._argmax: dict[int, GraphArgmax] = {}
        self.pool: Any = None

    def bucket_for(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def variant_for(self, b: int) -> str:
        """The kernel variant bucket `b` runs (chosen at capture; before it, the configured one)."""
        if b != 1 or self.kernels in ("cublas", "auto"):
            return self.chosen.get(b, "cublas")
        return self.kernels

    def forward(self, b: int, variant: str | None = None, raw_logits: bool = False,
                h: torch.Tensor | None = None) -> torch.Tensor:
        """Eager decode of the first b rows of the persistent buffers → float32 logits [b, vocab]
        (raw_logits: in the model dtype where the head computes them so, without a float32 copy;
        h: the ids' embeddings, when already gathered)."""
        m = self.model
        splits = K.choose_splits(b, m.cfg.num_heads, self.num_sms)
        attn = TritonDecodeAttention(m, self.cache, self.positions[:b], self.slots[:b], self.block_tables[:b],
                                     self.ctx_lens[:b], splits, self.merge_counters)
        if h is None:
            h = m.embed(self.ids[:b])
        v = self.variant_for(b) if variant is None else variant
        if v != "cublas" and b == 1:
            if m.layers[0].qkv.qformat == "fp8":  # e4m3 weights (quantize.py 'fp8')
                from tristream.engine.kernels.fp8_decode import decode_logits_b1_fp8

                return decode_logits_b1_fp8(m, h, attn, raw_logits=raw_logits, **b1_options(v))
            return decode_logits_b1(m, h, attn, raw_logits=raw_logits, **b1_options(v))
        x = m(h, attn, ops=TritonOps)
        return m.head()(x) if raw_logits else m.logits(x)

    def _candidates(self) -> tuple[str, ...]:
        """The batch-1 variants timed at capture: with PDL only the PDL variants (each measured
        faster than its plain twin on the H200)."""
        pdl = torch.cuda.get_device_capability(self.model.device)[0] >= 9
        return CAPTURE_PDL if pdl else CAPTURE_PLAIN

    def _time_variant(self, b: int, variant: str) -> float:
        """Milliseconds per replay of a throw-away graph of bucket b in one kernel variant."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.forward(b, variant)
        for _ in range(3):
            g.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            g.replay()
        e.record()
        e.synchronize()
        del g
        return s.elapsed_time(e) / 20

    def _choose_kernels(self) -> None:
        b = 1
        if b not in self.buckets:
            return
        if self.kernels != "auto":
            self.chosen[b] = self.variant_for(b)
            return
        ref = self.forward(b, "cublas")
        times = {"cublas": self._time_variant(b, "cublas")}
        for v in self._candidates():
            try:
                got = self.forward(b, v)
                err = float((got - ref).norm() / ref.norm().clamp(min=1e-30))
                self.choice_err.setdefault(b, {})[v] = err
                if not variant_agrees(got, ref, err):  # never pick a variant that disagrees with cuBLAS
                    raise ValueError(f"{v} logits differ from cuBLAS: rel err {err:.3g}")
                times[v] = self._time_variant(b, v)
            except Exception as exc:  # this variant is out; say why
                self.variant_errors.append(f"bucket {b} {v}: {type(exc).__name__}: {exc}"[:300])
        self.choice_ms[b] = times
        self.chosen[b] = min(times, key=lambda k: times[k])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (start-up only)."""
        if not self.use_graphs or self.graphs or self.model.device.type != "cuda":
            return
        self._fill_padding(0, self.max_bs)
        from tristream.engine.graph_capture import capture_buckets

        vocab = self.model.cfg.vocab_size
        self._argmax = {b: GraphArgmax(b, vocab, self.model.device) for b in self.buckets}

        def between() -> None:
            if self.kernels != "cublas":
                self._choose_kernels()
            for b in self.chosen:  # the chosen variants with the graph's tail, eagerly: all compiled now
                self._graph_forward(b)

        # the warm-up runs what each bucket will capture (before the choice at capture: the configured
        # variant, or cuBLAS under "auto", whose candidates `_choose_kernels` runs eagerly; after it, the
        # chosen ones): Triton kernels compile there, never inside a capture (a compile allocates enough to
        # start a GC pass, and a collected engine's pinned buffers or events freed mid-capture abort the process)
        self.hold_inputs()  # the warm-up runs the graphs' advance kernel: leave the inputs
        graphs, self.outputs, self.pool = capture_buckets(self.buckets, self._graph_forward, self.pool,
                                                          between=between)
        self.graphs = {b: _DecodeGraph(g, self, b) for b, g in graphs.items()}
        self.tokens = {b: self._argmax[b].out for b in self.graphs}

    def _graph_forward(self, b: int) -> torch.Tensor:
        """What bucket b's graph runs: the decode step, then its greedy tokens into `tokens[b]` and into
        the input ids (the next step's, when it is chained: `decode_chain.ChainedDecode`). Returns the
        head's logits as it computes them (the model dtype for the cuBLAS head): `logits` makes the
        float32 copy outside the graph, for the steps that sample otherwise (a copy in the graph, even
        on a forked stream, lengthened the greedy step: bench/results/llm_gpu_s11.json at 08aadf0)."""
        m = self.model
        h = advance_embed(self.dev_buf, m.embed_tokens, b, self.cache.block_size, self.o_pos, self.o_slot, self.o_ctx,
                          self.o_bt, self.o_flag, self.max_blocks)
        raw = self.forward(b, raw_logits=True, h=h)
        self._argmax[b](raw, self.ids[:b])
        return raw

    def hold_inputs(self) -> None:
        """Make every following replay use the inputs as they are, until the next copy (`prepare`):
        for benchmarks that replay one step many times."""
        self.dev_buf[self.o_flag] = HOLD
        self.on_device = self.pending = None

    def mapped_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]] | None:
        """Where the greedy tokens just launched (`run_greedy`'s or `ChainedDecode.launch_greedy`'s,
        before the bucket's next replay) already are in pinned host memory: the [≥ n] view, valid
        once that step is done, and the check to run then (`GraphArgmax.check_host`). None when no
        graph computed them."""
        b = self.bucket_for(int(tokens.shape[0]))
        own = self.tokens.get(b) if b is not None else None
        if b is None or own is None or tokens.data_ptr() != own.data_ptr() or not self._argmax[b].mapped:
            return None
        am = self._argmax[b]
        view, stamp = am.host_tokens()
        return view, lambda: am.check_host(stamp)

    def _replayed(self, b: int) -> None:
        """Bookkeeping of one replay of bucket b's graph (`_DecodeGraph.replay`)."""
        self._argmax[b].count_replay()
        self.ids_hint = None
        p = self.pending
        self.on_device = p if p is not None and p.bucket == b else None
        self.pending = None

    def input_state(self, b: int, seqs: list[Sequence], fed_pending: bool) -> InputState:
        """The inputs of a step of `seqs` in bucket b, as the host mirrors them. fed_pending: the token
        each sequence feeds is not in its keys yet (a chained step), else it is their last."""
        last = 0 if fed_pending else 1
        return InputState(b, tuple(s.seq_id for s in seqs), tuple(len(s.keys) - last - s.cache_offset for s in seqs),
                          tuple(len(s.block_table) for s in seqs))

    def skip_copy(self, state: InputState, ids_ready: bool) -> bool:
        """Whether the next replay's advance kernel makes `state` from the last replay's inputs
        (recorded, and nothing to copy then); ids_ready: the ids that replay left are the ones fed."""
        last = self.on_device
        if not ids_ready or last is None or not last.advanced(state, self.cache.block_size):
            return False
        self.pending = state
        return True

    def inputs_copied(self, state: InputState) -> None:
        """Record a queued copy of `state`'s inputs (which carries the FRESH flag)."""
        self.uploads += 1
        self.on_device = None
        self.pending = state

    def logits(self, b: int, n: int) -> torch.Tensor:
        """Float32 logits [n, vocab] of bucket b's last replay."""
        return self.outputs[b][:n].float()

    def _fill_padding(self, lo: int, hi: int) -> None:
        h = self.host_np
        h[lo:hi] = 0
        h[self.o_pos + lo:self.o_pos + hi] = 0
        h[self.o_slot + lo:self.o_slot + hi] = -1
        h[self.o_ctx + lo:self.o_ctx + hi] = 0

    def write_row(self, h: Any, i: int, s: Sequence, pos: int) -> None:
        """Write row i's inputs into host buffer `h` (numpy, this layout) for sequence s feeding
        logical position `pos`."""
        bs, mb = self.cache.block_size, self.max_blocks
        ci = pos - s.cache_offset  # its cache index (differs once blocks were evicted)
        bt = s.block_table
        h[self.o_pos + i] = pos
        h[self.o_slot + i] = bt[ci // bs] * bs + ci % bs
        h[self.o_ctx + i] = ci + 1
        o = self.o_bt + i * mb
        h[o:o + len(bt)] = bt

    def prepare(self, seqs: list[Sequence], rows: int, state: InputState | None = None) -> None:
        """Write the step's inputs for `seqs` (padded to `rows`) with one host→device copy (state: their
        `input_state`, when already made)."""
        h = self.host_np
        for i, s in enumerate(seqs):
            pos = len(s.keys) - 1  # logical position (RoPE)
            h[i] = s.keys[pos]
            self.write_row(h, i, s, pos)
        self._fill_padding(len(seqs), rows)
        h[self.o_flag] = FRESH
        used = self.o_bt + rows * self.max_blocks
        self.dev_buf[:used].copy_(self.host_buf[:used], non_blocking=True)
        self.inputs_copied(state or self.input_state(rows, seqs, fed_pending=False))

    def run_greedy(self, seqs: list[Sequence]) -> torch.Tensor:
        """Greedy token ids [len(seqs)] (int64, on the device) of one decode step: the graph's own
        argmax where the batch has a graph (a view of `tokens[b]`, overwritten by the bucket's next
        replay), else the argmax of `run`'s logits."""
        n = len(seqs)
        b = self.bucket_for(n)
        if b is None or b not in self.graphs:
            return greedy_tokens(self.run(seqs))
        self.prepare(seqs, b)
        self.graphs[b].replay()
        return self.tokens[b][:n]

    def run_greedy_host(self, seqs: list[Sequence]) -> list[int] | None:
        """Greedy token ids of one decode step as a host list, waiting for them: the graph's argmax read
        from its mapped host slot (no copy back, no float32 logits). The input copy is skipped when the
        step is the last replay's moved by one position and that replay's tokens are the ids being fed
        (`decode_inputs.InputState`). None (nothing run) when no graph runs the batch."""
        n = len(seqs)
        b = self.bucket_for(n)
        if b is None or b not in self.graphs or self._done is None:
            return None
        state = self.input_state(b, seqs, fed_pending=False)
        hint = self.ids_hint
        if not self.skip_copy(state, hint is not None and hint[:n] == tuple(s.keys[-1] for s in seqs)):
            self.prepare(seqs, b, state)
        self.graphs[b].replay()
        am = self._argmax[b]
        view, stamp = am.host_tokens()
        self._done.record()
        self._done.synchronize()
        am.check_host(stamp)
        toks: list[int] = view[:n].tolist()
        self.ids_hint = tuple(toks)
        return toks

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Float32 logits [len(seqs), vocab] for one decode step."""
        n = len(seqs)
        b = self.bucket_for(n)
        if b is None:  # beyond the largest bucket: run eagerly in slices of the largest
            parts = []
            for i in range(0, n, self.max_bs):
                parts.append(self.run(seqs[i:i + self.max_bs]).clone())
                if self.model.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()  # the pinned buffer is reused next slice
            return torch.cat(parts)
        self.prepare(seqs, b)
        if b in self.graphs:
            self.graphs[b].replay()
            return self.logits(b, n)
        self.on_device = self.pending = None  # the eager path leaves the FRESH flag unread: nothing mirrored
        return self.forward(b)[:n]


class _DecodeGraph:
    """A captured decode graph whose replays keep `DecodeGraphs`' host mirrors (the greedy tokens'
    host slot, the inputs on the device) in step. It holds its owner weakly: a reference cycle
    would leave a dropped engine's graphs to the cyclic garbage collector, which may run inside
    another engine's capture, where destroying a graph fails the capture."""

    __slots__ = ("graph", "owner", "bucket")

    def __init__(self, graph: torch.cuda.CUDAGraph, owner: DecodeGraphs, bucket: int) -> None:
        self.graph, self.owner, self.bucket = graph, weakref.ref(owner), bucket

    def replay(self) -> None:
        self.graph.replay()
        owner = self.owner()
        if owner is not None:
            owner._replayed(self.bucket)

