"""Model execution for one engine step: packed prefill chunks and decode batches.

Prefill (and all CPU work) runs eagerly through the torch attention backend. On CUDA,
decode runs through `DecodeGraphs` (Triton paged attention, one CUDA graph per batch bucket).
The runner only turns sequences into tensors; which sequences run is the engine's choice.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch

from tristream.engine.attention import AttnMetadata, SeqSlice, TorchAttention, causal_offset_mask
from tristream.engine.cpu.ops import NativeDecodeAttention, NativeDecoder, NativeOps
from tristream.engine.kv_cache import KVCache
from tristream.engine.linear import prefill_mode
from tristream.engine.models.llama import LlamaModel
from tristream.engine.packed_attention import (
    ChunkLayout,
    PackedAttention,
    PackedPrefillPlan,
    PagedPrefillPlan,
    StagingBuffer,
)
from tristream.engine.sampler import greedy_tokens
from tristream.engine.sequence import Sequence

_UNBUILT = object()


@dataclasses.dataclass(slots=True)
class PrefillChunk:
    """Positions [start, start + length) of a sequence's context to compute this step."""

    seq: Sequence
    start: int
    length: int
    want_logits: bool
    all_logits: bool = False  # logits at every position of the chunk (speculative verify), not only the last

    def cache_span(self) -> tuple[int, int]:
        """The chunk's positions as cache indexes [start, end): logical positions (what RoPE sees)
        less the sequence's `cache_offset` (what slots and the context length count)."""
        off = self.seq.cache_offset
        return self.start - off, self.start + self.length - off


def chunk_inputs(seq: Sequence, start: int, end: int, block_size: int
                 ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, torch.Tensor]]]:
    """Token keys, logical positions and embedding splices (row within the chunk, rows) of the
    positions counted [start, end) by `num_computed`. Contiguous (always without eviction):
    slices. A preempted sequence recomputing kept blocks between evicted ones: gathers."""
    pos = seq.positions(start, end, block_size)
    if pos is None:
        keys = np.asarray(seq.keys[start:end], dtype=np.int64)
        pos = np.arange(start, end, dtype=np.int64)
        runs = [(0, start, end)]
    else:
        keys = np.asarray(seq.keys, dtype=np.int64)[pos]
        cuts = [0, *(np.flatnonzero(np.diff(pos) != 1) + 1).tolist(), len(pos)]
        runs = [(a, int(pos[a]), int(pos[b - 1]) + 1) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    splices: list[tuple[int, torch.Tensor]] = []
    for seg_start, emb in seq.embeds:
        for row0, lo_run, hi_run in runs:
            lo, hi = max(seg_start, lo_run), min(seg_start + emb.shape[0], hi_run)
            if lo < hi:
                splices.append((row0 + lo - lo_run, emb[lo - seg_start:hi - seg_start]))
    return keys, pos, splices


def pack_inputs(chunks: list[PrefillChunk], block_size: int
                ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, torch.Tensor]]]:
    """Token keys and logical positions of the chunks laid end to end (`chunk_inputs` of each),
    and their embedding splices by row of the packed batch."""
    keys: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    splices: list[tuple[int, torch.Tensor]] = []
    q = 0
    for c in chunks:
        c_keys, c_pos, c_splices = chunk_inputs(c.seq, c.start, c.start + c.length, block_size)
        keys.append(c_keys)
        positions.append(c_pos)
        splices += [(q + row, emb) for row, emb in c_splices]
        q += c.length
    return np.concatenate(keys), np.concatenate(positions), splices


def logit_rows(chunks: list[PrefillChunk]) -> list[int]:
    """Rows of the chunks laid end to end whose logits are wanted: every row of an `all_logits`
    chunk, the last row of a `want_logits` one; in order."""
    rows: list[int] = []
    q = 0
    for c in chunks:
        if c.all_logits:
            rows.extend(range(q, q + c.length))
        q += c.length
        if c.want_logits and not c.all_logits:
            rows.append(q - 1)
    return rows


def splice_embeddings(h: torch.Tensor, splices: list[tuple[int, torch.Tensor]]) -> None:
    """Write embedding rows (vision tokens) over the token embeddings `h` at their rows."""
    for row, emb in splices:
        h[row:row + emb.shape[0]] = emb.to(device=h.device, dtype=h.dtype)


def slots_for(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions [start, end) under a block table."""
    bt = torch.tensor(block_table, dtype=torch.int64)
    pos = torch.arange(start, end, dtype=torch.int64)
    return bt[pos // block_size] * block_size + pos % block_size


def slots_np(block_table: list[int], end: int, block_size: int) -> np.ndarray:
    """Flat cache slots of positions [0, end) under a block table (host, numpy)."""
    nb = -(-end // block_size)
    bt = np.asarray(block_table[:nb], dtype=np.int64)
    return (bt[:, None] * block_size + np.arange(block_size, dtype=np.int64)[None, :]).reshape(-1)[:end]


def slots_range(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Flat cache slots of positions [start, end) under a block table (host, numpy)."""
    pos = np.arange(start, end, dtype=np.int64)
    bt = np.asarray(block_table[start // block_size:-(-end // block_size)], dtype=np.int64)
    return bt[pos // block_size - start // block_size] * block_size + pos % block_size


def _consecutive(block_table: list[int], end: int, block_size: int) -> bool:
    n = -(-end // block_size)
    b0 = block_table[0]
    return all(block_table[i] == b0 + i for i in range(1, n))


class ModelRunner:
    """Runs the model over the paged cache."""

    def __init__(self, model: LlamaModel, cache: KVCache, use_graphs: bool = True,
                 graph_buckets: tuple[int, ...] | None = None, max_model_len: int = 4096,
                 triton_decode: bool | None = None, decode_kernels: str = "auto",
                 packed_prefill: bool | None = None) -> None:
        """packed_prefill: all chunks of a step in one batched attention per layer (default: on
        CUDA; the per-sequence reference path elsewhere)."""
        self.model = model
        self.packed = self.model.device.type == "cuda" if packed_prefill is None else packed_prefill
        self.staging = StagingBuffer(model.device) if self.packed and model.device.type == "cuda" else None
        self.cache = cache
        self.device = model.device
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.decoder = None
        if triton_decode if triton_decode is not None else self.device.type == "cuda":
            from tristream.engine.graphs import DecodeGraphs

            self.decoder = DecodeGraphs(model, cache, max_model_len=max_model_len,
                                        buckets=graph_buckets, use_graphs=use_graphs, kernels=decode_kernels)
        self.ops: Any = None
        self.native: Any = None  # the native CPU kernels (float32 models on CPU), when they load
        self._decoder: NativeDecoder | None = None
        self._decoder_for: Any = _UNBUILT  # the weights the decoder was built over
        if self.device.type == "cpu" and model.dtype == torch.float32:
            from tristream.engine.linear import native_kernels

            self.native = native_kernels()
            if self.native is not None:
                self.ops = NativeOps(self.native)
        self.paged_block_m = 0  # > 0: prefill attention through the Triton paged kernel
        self.use_graphs = use_graphs
        self.prefill_graphs: Any = None  # PrefillGraphs once captured (CUDA, paged kernel)
        if self.device.type == "cuda":  # fused norm / SiLU kernels for prefill too: fewer launches
            from tristream.engine.graphs import TritonOps
            from tristream.engine.kernels.prefill_attention import block_m

            self.ops = TritonOps
            hd = model.cfg.head_dim
            if self.packed and hd >= 16 and not hd & (hd - 1):
                self.paged_block_m = block_m(model.cfg.num_heads // model.cfg.num_kv_heads)

    def capture(self) -> None:
        """Capture decode graphs and warm the prefill kernels now (at start-up, never while serving).
        Small prefill steps get CUDA graphs too (`prefill_graphs.py`; TRISTREAM_PREFILL_GRAPHS=0
        turns them off)."""
        if self.decoder is not None:
            self.decoder.capture()
        self.warmup_prefill()
        if (self.use_graphs and self.paged_block_m > 0 and self.prefill_graphs is None
                and os.environ.get("TRISTREAM_PREFILL_GRAPHS", "1") != "0"):
            from tristream.engine.prefill_graphs import PrefillGraphs

            graphs = PrefillGraphs(self.model, self.cache, self.paged_block_m, self.max_model_len)
            graphs.capture()
            self.prefill_graphs = graphs

    @torch.inference_mode()
    def warmup_prefill(self) -> None:
        """Run the packed prefill path over a few shapes so that its Triton kernels compile every
        specialisation (1 row, multiples of 16, others) at start-up. CUDA only; block 0 is
        scratch (nothing is cached yet, and a position's K/V is always written before it is read)."""
        if self.device.type != "cuda" or not self.packed:
            return
        from tristream.engine.sequence import Sequence

        for lens in ((1, 1), (2, 3), (16, 1), (17, 5), (32, 16, 2), (1, 2, 3, 4, 5, 6, 7, 8)):
            chunks = []
            for n in lens:
                s = Sequence(keys=[0] * (n + 3))
                s.block_table = [0] * (-(-(n + 3) // self.block_size))
                chunks.append(PrefillChunk(s, 3, n, True))
            self.prefill(chunks)
        torch.cuda.synchronize(self.device)

    def _inputs(self, chunks: list[PrefillChunk]) -> tuple[torch.Tensor, AttnMetadata]:
        model, bs = self.model, self.block_size
        keys, positions, splices = pack_inputs(chunks, bs)
        slots: list[torch.Tensor] = []
        seqs: list[SeqSlice] = []
        q = 0
        for c in chunks:
            s = c.seq
            cstart, cend = c.cache_span()
            slots.append(slots_for(s.block_table, cstart, cend, bs))
            if cstart == 0:
                seqs.append(SeqSlice(q, c.length, cend))
            else:
                kv = slots_for(s.block_table, 0, cend, bs)
                first = int(kv[0])
                consecutive = int(kv[-1]) - first == cend - 1 and _consecutive(s.block_table, cend, bs)
                mask = causal_offset_mask(c.length, cend, self.device) if c.length > 1 else None
                seqs.append(SeqSlice(q, c.length, cend, kv_index=kv.to(self.device), mask=mask,
                                     kv_start=first if consecutive else None))
            q += c.length
        ids = torch.from_numpy(keys).clamp_(min=0).to(self.device)
        h = model.embed(ids)
        splice_embeddings(h, splices)
        meta = AttnMetadata(
            positions=torch.from_numpy(positions).to(self.device), seqs=seqs,
            slot_mapping=torch.cat(slots).to(self.device),
        )
        return h, meta

    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk]) -> torch.Tensor | None:
        """Compute the chunks' K/V; float32 logits [n, vocab] for chunks with want_logits, in order."""
        with prefill_mode():
            return self._forward(chunks)

    def _forward(self, chunks: list[PrefillChunk]) -> torch.Tensor | None:
        # a lone fresh prompt needs no cache reads: plain causal SDPA, except on CUDA, where
        # SDPA may pick cuDNN, which builds a plan per new shape (~50 ms, seconds the first time)
        if self.packed and (self.paged_block_m > 0 or not (len(chunks) == 1 and chunks[0].start == 0)):
            return self._forward_packed(chunks)
        h, meta = self._inputs(chunks)
        attn: Any
        decode = self.native is not None and NativeDecodeAttention.applies(meta, self.cache)
        decoder = self._native_decoder() if decode else None
        if decoder is not None:
            out = decoder.forward(h, meta, self.ops)
        else:
            if decode:
                attn = NativeDecodeAttention(self.model.cfg, self.model.cos_sin, meta, self.cache, self.native)
            else:
                attn = TorchAttention(self.model.cfg, self.model.cos_sin, meta, self.cache, self.model.dtype)
            out = self.model(h, attn, ops=self.ops)
        rows = logit_rows(chunks)
        if not rows:
            return None
        return self.model.logits(out[torch.tensor(rows, device=out.device)])

    def _native_decoder(self) -> NativeDecoder | None:
        """The all-layers native decode step, built on first use and again if the weights were
        re-quantised (None where it does not apply)."""
        key = self.model.layers[0].qkv.qtensors.get("w")
        if self._decoder_for is not key:
            ok = NativeDecoder.applies(self.model, self.cache)
            self._decoder = NativeDecoder(self.model, self.cache, self.native) if ok else None
            self._decoder_for = key
        return self._decoder

    def _forward_packed(self, chunks: list[PrefillChunk]) -> torch.Tensor | None:
        """All chunks through one forward with batched attention; indices reach the device in one copy."""
        model, bs = self.model, self.block_size
        cfg = model.cfg
        keys, positions, splices = pack_inputs(chunks, bs)
        slots: list[np.ndarray] = []
        layouts: list[ChunkLayout] = []
        q = 0
        tables: list[np.ndarray] = []
        paged = self.paged_block_m > 0
        for c in chunks:
            s = c.seq
            cstart, cend = c.cache_span()
            if paged:
                slots.append(slots_range(s.block_table, cstart, cend, bs))
                tables.append(np.asarray(s.block_table[:-(-cend // bs)], dtype=np.int64))
                layouts.append(ChunkLayout(q, c.length, cend, slots[-1]))
            else:
                kv = slots_np(s.block_table, cend, bs)
                slots.append(kv[cstart:cend])
                layouts.append(ChunkLayout(q, c.length, cend, kv))
            q += c.length
        rows = logit_rows(chunks)
        g = self.prefill_graphs
        if paged and g is not None and not splices and g.fits(q, len(chunks), max(len(t) for t in tables)):
            return g.run(np.maximum(keys, 0), positions, np.concatenate(slots), rows,
                         [lay.q_start for lay in layouts], [lay.q_len for lay in layouts],
                         [lay.ctx_len for lay in layouts], tables)
        host = [np.maximum(keys, 0), positions, np.concatenate(slots),
                np.asarray(rows, dtype=np.int64)]
        plan: PackedPrefillPlan | PagedPrefillPlan
        if paged:
            plan = PagedPrefillPlan(layouts, tables, self.paged_block_m, self.device, host, staging=self.staging)
        else:
            plan = PackedPrefillPlan(layouts, cfg.num_heads // cfg.num_kv_heads, model.dtype, self.device, host,
                                     staging=self.staging)
        d_ids, d_pos, d_slots, d_rows = plan.extra
        h = model.embed(d_ids)
        splice_embeddings(h, splices)
        attn = PackedAttention(cfg, model.cos_sin, d_pos, d_slots, plan, self.cache, model.dtype,
                               fused_rope=self.device.type == "cuda")
        out = model(h, attn, ops=self.ops)
        if not rows:
            return None
        return model.logits(out.index_select(0, d_rows))

    @torch.inference_mode()
    def decode_greedy(self, seqs: list[Sequence]) -> torch.Tensor:
        """Greedy token ids [B] (int64, on the model's device) for the last (pending) token of each
        sequence: a decode graph's own argmax where one runs the batch (`DecodeGraphs.run_greedy`)."""
        if self.decoder is not None:
            return self.decoder.run_greedy(seqs)
        return greedy_tokens(self.decode(seqs))

    @torch.inference_mode()
    def decode_greedy_host(self, seqs: list[Sequence]) -> list[int] | None:
        """Greedy token ids of a decode step as a host list, where a decode graph runs the batch
        (`DecodeGraphs.run_greedy_host`: its own argmax, read from mapped host memory); else None,
        having run nothing."""
        return self.decoder.run_greedy_host(seqs) if self.decoder is not None else None

    @torch.inference_mode()
    def verify(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """Float32 logits [sum of chunk lengths, vocab] at every position of the chunks, in one
        forward (speculative verify: each chunk is a decode sequence's pending token and its
        draft). Runs outside `prefill_mode`, so quantised layers compute with the weights that
        decode uses. On the per-sequence path (CPU) every position runs as a decode row of its
        own (context up to and including it): the decode kernels (`NativeDecoder`,
        `NativeDecodeAttention`, `TorchAttention`) store every row's K/V before any row attends,
        so a row sees the draft positions before it, and a verify step costs a decode batch of
        k+1 rows. The packed path scores the chunks with logits at every position."""
        if self.packed:
            rows = [dataclasses.replace(c, all_logits=True) for c in chunks]
        else:
            rows = [PrefillChunk(c.seq, c.start + i, 1, True) for c in chunks for i in range(c.length)]
        logits = self._forward(rows)
        assert logits is not None
        return logits

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Float32 logits [B, vocab] for the last (pending) token of each sequence."""
        if self.decoder is not None:
            return self.decoder.run(seqs)
        chunks = [PrefillChunk(s, len(s.keys) - 1, 1, True) for s in seqs]
        logits = self._forward(chunks)
        assert logits is not None
        return logits
