"""CUDA graphs of small prefill steps (incremental prefill: a few tokens for many sessions).

A step that appends 8–40 tokens to a handful of sessions costs the GPU about a millisecond,
but its eager launch sequence (five Triton kernels and four GEMMs per layer, each launched
from Python) costs the host several. The paged prefill kernel takes every index from device
memory, so such a step is capturable: per token bucket (16, 32, 64, 128, 256 tokens) one graph over
persistent buffers, with room for `max_chunks` chunks and the worst-case number of query
tiles. Per step the host fills one pinned buffer (token ids, positions, cache slots, logit
rows, tiles, per-chunk q_start/q_len/ctx_len, block tables at a fixed stride) and copies it
with one asynchronous copy; then the graph replays.

Padding writes nowhere: padded tokens have slot −1 (the rope/store kernel skips them), spare
tiles point at a dummy chunk with q_len 0 (the attention kernel stores nothing for it), spare
logit rows read row 0 and are dropped. Steps with precomputed embeddings (vision tokens),
more chunks or tokens than the largest bucket, or a block table longer than `max_model_len`
allows, run eagerly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tristream.engine.kv_cache import KVCache
from tristream.engine.linear import prefill_mode
from tristream.engine.models.llama import LlamaModel
from tristream.engine.packed_attention import PART_ALIGN, PackedAttention, PagedPrefillPlan

DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256)


def _align(n: int) -> int:
    return -(-n // PART_ALIGN) * PART_ALIGN


class PrefillGraphs:
    """Persistent prefill inputs and one CUDA graph per token bucket."""

    def __init__(self, model: LlamaModel, cache: KVCache, block_m: int, max_model_len: int,
                 token_buckets: tuple[int, ...] = DEFAULT_TOKEN_BUCKETS, max_chunks: int = 16) -> None:
        from tristream.engine.graphs import TritonOps

        self.model = model
        self.cache = cache
        self.ops = TritonOps
        self.block_m = block_m
        self.buckets = tuple(sorted(token_buckets))
        self.max_tokens = self.buckets[-1]
        self.max_chunks = max_chunks
        self.max_blocks = -(-max_model_len // cache.block_size)
        t, c = self.max_tokens, max_chunks
        self.max_tiles = {b: b // block_m + c for b in self.buckets}
        mt = self.max_tiles[self.max_tokens]
        # layout of the flat int64 buffer: every part 128-byte aligned
        sizes = {"ids": t, "pos": t, "slots": t, "rows": c, "tile_chunk": mt, "tile_m0": mt,
                 "q_start": c + 1, "q_len": c + 1, "ctx_len": c + 1, "bt_off": c + 1, "bt": c * self.max_blocks}
        self.off: dict[str, int] = {}
        total = 0
        for k, n in sizes.items():
            self.off[k] = total
            total += _align(n)
        self.sizes = sizes
        dev = model.device
        self.dev = torch.zeros(total, dtype=torch.int64, device=dev)
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.h = self.host.numpy()
        self.h[self.off["bt_off"]:self.off["bt_off"] + c] = np.arange(c) * self.max_blocks
        self.h[self.off["bt_off"] + c] = 0  # the dummy chunk (index c): q_len 0, ctx_len 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None
        self.copied: torch.cuda.Event | None = None
        self.replays = 0

    def _view(self, name: str, n: int | None = None) -> torch.Tensor:
        o = self.off[name]
        return self.dev[o:o + (self.sizes[name] if n is None else n)]

    def bucket_for(self, tokens: int) -> int | None:
        for b in self.buckets:
            if tokens <= b:
                return b
        return None

    def fits(self, tokens: int, chunks: int, longest_table: int) -> bool:
        return tokens <= self.max_tokens and chunks <= self.max_chunks and longest_table <= self.max_blocks

    def forward(self, b: int) -> torch.Tensor:
        """The bucket's forward over the persistent buffers: logits [max_chunks, vocab]."""
        m = self.model
        mt = self.max_tiles[b]
        plan = PagedPrefillPlan.from_views(
            [], self._view("tile_chunk", mt), self._view("tile_m0", mt), self._view("q_start"), self._view("q_len"),
            self._view("ctx_len"), self._view("bt_off"), self._view("bt"))
        with prefill_mode():
            h = m.embed(self._view("ids", b))
            attn = PackedAttention(m.cfg, m.cos_sin, self._view("pos", b), self._view("slots", b), plan, self.cache,
                                   m.dtype, fused_rope=True)
            out = m(h, attn, ops=self.ops)
            return m.logits(out.index_select(0, self._view("rows")))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every bucket up (Triton compiles), then capture them, largest first, in one pool.
        Nothing is cached yet: padded steps write nowhere and read only the dummy chunk."""
        self._reset(0, self.max_tokens, 0)
        self.dev.copy_(self.host)
        from tristream.engine.graph_capture import capture_buckets

        self.graphs, self.outputs, self.pool = capture_buckets(self.buckets, self.forward, self.pool)

    def _reset(self, n_tokens: int, bucket: int, n_tiles: int) -> None:
        """Padding of the host buffer beyond the step's real tokens and tiles."""
        h, o = self.h, self.off
        h[o["ids"] + n_tokens:o["ids"] + bucket] = 0
        h[o["pos"] + n_tokens:o["pos"] + bucket] = 0
        h[o["slots"] + n_tokens:o["slots"] + bucket] = -1
        mt = self.max_tiles[bucket]
        h[o["tile_chunk"] + n_tiles:o["tile_chunk"] + mt] = self.max_chunks
        h[o["tile_m0"] + n_tiles:o["tile_m0"] + mt] = 0

    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, rows: list[int],
            q_start: list[int], q_len: list[int], ctx_len: list[int], tables: list[np.ndarray]) -> torch.Tensor | None:
        """One prefill step through its bucket's graph; float32 logits [len(rows), vocab] or None."""
        n = len(ids)
        b = self.bucket_for(n)
        assert b is not None and len(q_len) <= self.max_chunks
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        h, o = self.h, self.off
        h[o["ids"]:o["ids"] + n] = ids
        h[o["pos"]:o["pos"] + n] = positions
        h[o["slots"]:o["slots"] + n] = slots
        h[o["rows"]:o["rows"] + self.max_chunks] = 0
        h[o["rows"]:o["rows"] + len(rows)] = rows
        k = len(q_len)
        h[o["q_start"]:o["q_start"] + k] = q_start
        h[o["q_len"]:o["q_len"] + k] = q_len
        h[o["ctx_len"]:o["ctx_len"] + k] = ctx_len
        tiles = [-(-q // self.block_m) for q in q_len]
        n_tiles = sum(tiles)
        h[o["tile_chunk"]:o["tile_chunk"] + n_tiles] = np.repeat(np.arange(k), tiles)
        h[o["tile_m0"]:o["tile_m0"] + n_tiles] = np.concatenate([np.arange(t) * self.block_m for t in tiles])
        bt0 = o["bt"]
        for i, t in enumerate(tables):
            h[bt0 + i * self.max_blocks:bt0 + i * self.max_blocks + len(t)] = t
        self._reset(n, b, n_tiles)
        used = bt0 + k * self.max_blocks
        self.dev[:used].copy_(self.host[:used], non_blocking=True)
        if self.dev.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()
        self.graphs[b].replay()
        self.replays += 1
        return self.outputs[b][:len(rows)] if rows else None
