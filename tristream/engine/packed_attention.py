"""Batched (varlen) prefill attention: every prefill chunk of a step in one forward.

The reference backend (`attention.TorchAttention`) runs one SDPA per sequence and layer, and
builds each sequence's cache index and mask with separate small host→device copies: with 30
sequences and 16 layers a step issues ~3000 attention launches. Here a step's chunks are laid
out once, on the host, into a few padded groups (sequences of similar chunk length share a
group, so padding stays bounded), and every index the step needs travels in ONE host→device
copy. Per layer and group the attention is then a fixed number of launches, independent of the
number of sequences:

    q  = gather packed queries into [B, kv_heads, group * Lq, hd]   (GQA folded into the rows)
    kv = gather the contexts from the paged cache into [B, kv_heads, Lk, hd]
    o  = scaled_dot_product_attention(q, k, v, additive mask [B, 1, group * Lq, Lk])
    out[rows] = o[valid rows]

Folding the query heads of one KV head into the query length avoids expanding K/V for GQA and
lets CUDA use the memory-efficient kernel with an arbitrary mask. The mask is causal with the
cached prefix in front of each chunk (query i of a chunk of q_len tokens ending at ctx_len sees
keys j ≤ ctx_len - q_len + i); padded query rows repeat the chunk's last row and are dropped,
padded keys are masked. On CUDA rope and the K/V cache write run as one Triton kernel
(`rope_store`, shared with the decode graphs); elsewhere the torch reference ops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import numpy as np
import torch
import torch.nn.functional as F

from tristream.engine.config import ModelConfig
from tristream.engine.kv_cache import KVCache
from tristream.engine.rope import apply_rope

GPU_GROUP_SLACK = 1 << 19  # query-key pairs one group's ~10 launches per layer are worth on a GPU
CPU_GROUP_SLACK = 1 << 12
KEY_ALIGN = 16  # padded key length multiple (mask rows stay aligned for the CUDA kernels)
PART_ALIGN = 16  # int64 elements: each index array of a plan starts 128-byte aligned


@dataclasses.dataclass(slots=True)
class ChunkLayout:
    """Host description of one chunk: where its queries sit and which cache slots hold its context."""

    q_start: int  # first row in the packed batch
    q_len: int
    ctx_len: int  # context length after this step (cached prefix + q_len)
    kv_slots: np.ndarray  # [ctx_len] int64 cache slots of positions 0..ctx_len-1


@dataclasses.dataclass(slots=True)
class PackedGroup:
    """Device tensors of one padded group of chunks (B chunks, Lq queries, Lk keys)."""

    batch: int
    q_len: int
    k_len: int
    q_src: torch.Tensor  # [B * Lq] packed row feeding each padded query row
    rows: torch.Tensor  # [T_g] packed rows of this group's real queries
    pad_rows: torch.Tensor  # [T_g] their padded row b * Lq + i
    kv_src: torch.Tensor  # [B * Lk] cache slots (padding: the chunk's first slot, masked)
    mask: torch.Tensor  # [B, 1, G * Lq, Lk] additive (0 / -inf) in the model dtype


def _work(q_len: int, k_len: int, n: int) -> int:
    return n * q_len * -(-k_len // KEY_ALIGN) * KEY_ALIGN


def group_chunks(q_lens: Seq[int], ctx_lens: Seq[int], slack: int) -> list[list[int]]:
    """Indices of chunks grouped for padded attention, longest chunk first.

    A group's attention work is B × max q_len × max ctx_len (query-key pairs). A chunk joins the
    current group while that costs at most `slack` pairs more than running it as a group of its
    own; `slack` prices one extra group's fixed launches (large on a GPU, small on a CPU). So a
    group's work is at most the sum of its chunks' own work plus `slack` per chunk added.
    """
    order = sorted(range(len(q_lens)), key=lambda i: (-q_lens[i], -ctx_lens[i]))
    groups: list[list[int]] = []
    cur: list[int] = []
    lq = lk = 0
    for i in order:
        if cur:
            merged = _work(lq, max(lk, ctx_lens[i]), len(cur) + 1)
            if merged > _work(lq, lk, len(cur)) + _work(q_lens[i], ctx_lens[i], 1) + slack:
                groups.append(cur)
                cur = []
        if not cur:
            lq, lk = q_lens[i], ctx_lens[i]
        cur.append(i)
        lk = max(lk, ctx_lens[i])
    if cur:
        groups.append(cur)
    return groups


class StagingBuffer:
    """A reusable pinned int64 host buffer for one asynchronous host→device copy per step.

    `take(n)` waits (only) for the previous copy out of the buffer to finish before handing it
    out again, so reusing it never races with a copy still queued behind GPU work."""

    def __init__(self, device: torch.device, size: int = 1 << 16) -> None:
        self.device = device
        self.buf = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        self.done: torch.cuda.Event | None = None

    def take(self, n: int) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        if n > self.buf.shape[0]:
            self.buf = torch.zeros(max(n, 2 * self.buf.shape[0]), dtype=torch.int64, pin_memory=True)
        out = self.buf[:n]
        out.zero_()
        return out

    def record(self) -> None:
        """Mark the copy just issued from the buffer."""
        self.done = torch.cuda.Event()
        self.done.record()


class PackedPrefillPlan:
    """All index tensors of one step's prefill, built on the host and copied to the device once."""

    def __init__(self, chunks: list[ChunkLayout], group_size: int, dtype: torch.dtype,
                 device: torch.device, extra: list[np.ndarray] | None = None, slack: int | None = None,
                 staging: StagingBuffer | None = None) -> None:
        """`extra`: more int64 host arrays (token ids, positions, ...) to ship in the same copy;
        their device views are in `self.extra` in order. `staging`: a pinned host buffer that
        makes the copy asynchronous (else a pageable copy, which may wait for the stream)."""
        self.group_size = group_size
        parts: list[np.ndarray] = [np.asarray(a, dtype=np.int64) for a in (extra or [])]
        n_extra = len(parts)
        shapes: list[tuple[int, int, int, int]] = []  # (batch, Lq, Lk, rows) per group
        if slack is None:
            slack = GPU_GROUP_SLACK if device.type == "cuda" else CPU_GROUP_SLACK
        for idx in group_chunks([c.q_len for c in chunks], [c.ctx_len for c in chunks], slack):
            cs = [chunks[i] for i in idx]
            b, lq = len(cs), max(c.q_len for c in cs)
            lk = -(-max(c.ctx_len for c in cs) // KEY_ALIGN) * KEY_ALIGN
            i = np.arange(lq)
            q_src = np.concatenate([c.q_start + np.minimum(i, c.q_len - 1) for c in cs])
            rows = np.concatenate([c.q_start + np.arange(c.q_len) for c in cs])
            pad_rows = np.concatenate([k * lq + np.arange(c.q_len) for k, c in enumerate(cs)])
            kv = np.empty((b, lk), dtype=np.int64)
            lim = np.empty((b, lq), dtype=np.int64)
            for k, c in enumerate(cs):
                kv[k, :c.ctx_len] = c.kv_slots
                kv[k, c.ctx_len:] = c.kv_slots[0]
                lim[k] = c.ctx_len - c.q_len + np.minimum(i, c.q_len - 1)
            parts += [q_src, rows, pad_rows, kv.ravel(), lim.ravel()]
            shapes.append((b, lq, lk, len(rows)))
        views = ship(parts, device, staging)
        self.extra = views[:n_extra]
        self.groups: list[PackedGroup] = []
        pos = n_extra
        for b, lq, lk, _ in shapes:
            d_q_src, d_rows, d_pad_rows, d_kv_src, d_lim = views[pos:pos + 5]
            pos += 5
            allowed = torch.arange(lk, device=device)[None, None, :] <= d_lim.view(b, lq, 1)  # [B, Lq, Lk]
            allowed = allowed[:, None, None].expand(b, 1, group_size, lq, lk).reshape(b, 1, group_size * lq, lk)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
            self.groups.append(PackedGroup(b, lq, lk, d_q_src, d_rows, d_pad_rows, d_kv_src, mask))


def ship(parts: list[np.ndarray], device: torch.device, staging: StagingBuffer | None) -> list[torch.Tensor]:
    """int64 host arrays → device views, in ONE host→device copy; each part starts 128-byte
    aligned, so kernels (Triton specialises on pointer alignment) see the same alignment every
    step and nothing recompiles while serving."""
    sizes = [len(p) for p in parts]
    padded = [-(-n // PART_ALIGN) * PART_ALIGN for n in sizes]
    total = max(PART_ALIGN, sum(padded))
    host = staging.take(total) if staging is not None else torch.zeros(total, dtype=torch.int64)
    flat_np = host.numpy()
    off = 0
    offsets = []
    for p, n in zip(parts, padded, strict=True):
        flat_np[off:off + len(p)] = p
        offsets.append(off)
        off += n
    dev_flat = host.to(device, non_blocking=staging is not None)
    if staging is not None:
        staging.record()
    return [dev_flat[o:o + n] for o, n in zip(offsets, sizes, strict=True)]


class PagedPrefillPlan:
    """Index arrays of one step's prefill for the Triton paged prefill kernel (CUDA).

    Unlike `PackedPrefillPlan` nothing is padded or gathered: per chunk its first packed row,
    q_len, ctx_len and its block table (concatenated into one flat array), plus the list of
    query tiles (chunk, first query) the kernel's grid runs over."""

    def __init__(self, chunks: list[ChunkLayout], block_tables: list[np.ndarray], block_m: int,
                 device: torch.device, extra: list[np.ndarray] | None = None,
                 staging: StagingBuffer | None = None) -> None:
        parts: list[np.ndarray] = [np.asarray(a, dtype=np.int64) for a in (extra or [])]
        n_extra = len(parts)
        tiles = [(-(-c.q_len // block_m)) for c in chunks]
        tile_chunk = np.repeat(np.arange(len(chunks), dtype=np.int64), tiles)
        tile_m0 = np.concatenate([np.arange(n, dtype=np.int64) * block_m for n in tiles]) if chunks else \
            np.zeros(0, dtype=np.int64)
        bt_lens = np.asarray([len(b) for b in block_tables], dtype=np.int64)
        bt_off = np.concatenate([[0], np.cumsum(bt_lens)[:-1]]).astype(np.int64)
        parts += [tile_chunk, tile_m0,
                  np.asarray([c.q_start for c in chunks], dtype=np.int64),
                  np.asarray([c.q_len for c in chunks], dtype=np.int64),
                  np.asarray([c.ctx_len for c in chunks], dtype=np.int64),
                  bt_off, np.concatenate(block_tables).astype(np.int64)]
        views = ship(parts, device, staging)
        self.extra = views[:n_extra]
        (self.tile_chunk, self.tile_m0, self.q_start, self.q_len, self.ctx_len, self.bt_off,
         self.block_tables) = views[n_extra:]

    @classmethod
    def from_views(cls, extra: list[torch.Tensor], tile_chunk: torch.Tensor, tile_m0: torch.Tensor,
                   q_start: torch.Tensor, q_len: torch.Tensor, ctx_len: torch.Tensor, bt_off: torch.Tensor,
                   block_tables: torch.Tensor) -> PagedPrefillPlan:
        """A plan over existing device tensors (the persistent buffers of `PrefillGraphs`)."""
        plan = cls.__new__(cls)
        plan.extra = extra
        (plan.tile_chunk, plan.tile_m0, plan.q_start, plan.q_len, plan.ctx_len, plan.bt_off,
         plan.block_tables) = tile_chunk, tile_m0, q_start, q_len, ctx_len, bt_off, block_tables
        return plan


class PackedAttention:
    """Attention backend over a `PackedPrefillPlan`: a fixed number of launches per layer and group."""

    def __init__(self, cfg: ModelConfig, cos_sin: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, plan: PackedPrefillPlan | PagedPrefillPlan, cache: KVCache, dtype: torch.dtype,
                 fused_rope: bool = False) -> None:
        self.cfg = cfg
        self.cache = cache
        self.plan = plan
        self.positions = positions
        self.slot_mapping = slot_mapping
        self.cos_sin = cos_sin
        self.fused_rope = fused_rope
        if not fused_rope:
            half = cfg.head_dim // 2
            cs = cos_sin.index_select(0, positions).to(dtype)
            self.cos = cs[:, None, :half]
            self.sin = cs[:, None, half:]
        self.scale = cfg.head_dim ** -0.5

    def _rope_store(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        t, hd = qkv.shape[0], cfg.head_dim
        kc, vc = self.cache.flat(layer)
        if self.fused_rope:
            from tristream.engine.kernels.triton_ops import rope_store

            return rope_store(qkv, self.positions, self.cos_sin, self.slot_mapping, kc, vc,
                              cfg.num_heads, cfg.num_kv_heads, hd)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = apply_rope(q.view(t, cfg.num_heads, hd), self.cos, self.sin)
        k = apply_rope(k.view(t, cfg.num_kv_heads, hd), self.cos, self.sin)
        kc.index_copy_(0, self.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, self.slot_mapping, v.reshape(t, cfg.num_kv_heads, hd).to(vc.dtype))
        return q

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        t, hd, nkv = qkv.shape[0], cfg.head_dim, cfg.num_kv_heads
        grp = cfg.num_heads // nkv
        q = self._rope_store(layer, qkv)  # [T, heads, hd]
        kc, vc = self.cache.flat(layer)
        if isinstance(self.plan, PagedPrefillPlan):
            from tristream.engine.kernels.prefill_attention import paged_prefill_attention

            p = self.plan
            o = paged_prefill_attention(q, kc, vc, p.tile_chunk, p.tile_m0, p.q_start, p.q_len, p.ctx_len,
                                        p.bt_off, p.block_tables, self.cache.block_size, self.scale)
            return o.view(t, cfg.q_size)
        assert isinstance(self.plan, PackedPrefillPlan)
        out = torch.empty(t, cfg.q_size, dtype=q.dtype, device=q.device)
        for g in self.plan.groups:
            b, lq, lk = g.batch, g.q_len, g.k_len
            qp = (q.index_select(0, g.q_src).view(b, lq, nkv, grp, hd)
                  .permute(0, 2, 3, 1, 4).reshape(b, nkv, grp * lq, hd))
            kp = kc.index_select(0, g.kv_src).view(b, lk, nkv, hd).transpose(1, 2).to(q.dtype)
            vp = vc.index_select(0, g.kv_src).view(b, lk, nkv, hd).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=g.mask, scale=self.scale)
            # the CUDA kernels may return o with a permuted layout: reshape, never view
            o = o.reshape(b, nkv, grp, lq, hd).permute(0, 3, 1, 2, 4).reshape(b * lq, cfg.q_size)
            out.index_copy_(0, g.rows, o.index_select(0, g.pad_rows))
        return out
