"""Attention metadata for a packed batch and the torch reference backend.

A step's tokens are packed into one [T, ...] batch. `AttnMetadata` says where each
sequence's queries sit in that batch, how long its context is after this step, and which
KV-cache slots hold its keys/values (`kv_index`, gathered through the block table). The
torch backend here serves CPU inference, tests and GPU prefill (through
`scaled_dot_product_attention`); the GPU decode path lives in `kernels/` and `graphs.py`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from tristream.engine.config import ModelConfig
from tristream.engine.kv_cache import KVCache
from tristream.engine.rope import apply_rope


@dataclasses.dataclass(slots=True)
class SeqSlice:
    """One sequence's queries in a packed batch."""

    q_start: int
    q_len: int
    ctx_len: int  # tokens of context after this step, including the q_len new ones
    kv_index: torch.Tensor | None = None  # [ctx_len] cache slots, None for dense attention
    mask: torch.Tensor | None = None  # [q_len, ctx_len] bool when a cached prefix precedes the chunk
    kv_start: int | None = None  # set when the context's slots are consecutive: a view, no gather


@dataclasses.dataclass(slots=True)
class AttnMetadata:
    """Positions, cache slots and per-sequence layout of one packed batch."""

    positions: torch.Tensor  # [T] int64
    seqs: list[SeqSlice]
    slot_mapping: torch.Tensor | None = None  # [T] int64 cache slot per new token; None = no cache

    @staticmethod
    def dense(num_tokens: int, device: torch.device | str = "cpu") -> AttnMetadata:
        """One sequence, no KV cache: plain causal attention (the contiguous reference)."""
        pos = torch.arange(num_tokens, device=device)
        return AttnMetadata(positions=pos, seqs=[SeqSlice(0, num_tokens, num_tokens)])


def causal_offset_mask(q_len: int, ctx_len: int, device: torch.device | str) -> torch.Tensor:
    """Bool mask [q_len, ctx_len]: query i (at position ctx_len - q_len + i) sees keys ≤ itself."""
    qpos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    return torch.arange(ctx_len, device=device)[None, :] <= qpos[:, None]


class TorchAttention:
    """Reference attention: rope, scatter new K/V into the paged cache, SDPA per sequence."""

    def __init__(
        self, cfg: ModelConfig, cos_sin: torch.Tensor, meta: AttnMetadata, cache: KVCache | None,
        dtype: torch.dtype,
    ) -> None:
        self.cfg = cfg
        self.meta = meta
        self.cache = cache
        half = cfg.head_dim // 2
        cs = cos_sin.index_select(0, meta.positions).to(dtype)
        self.cos = cs[:, None, :half]
        self.sin = cs[:, None, half:]
        self.scale = cfg.head_dim ** -0.5

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        t = qkv.shape[0]
        hd = cfg.head_dim
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = apply_rope(q.view(t, cfg.num_heads, hd), self.cos, self.sin)
        k = apply_rope(k.view(t, cfg.num_kv_heads, hd), self.cos, self.sin)
        v = v.reshape(t, cfg.num_kv_heads, hd)
        meta = self.meta
        if self.cache is not None and meta.slot_mapping is not None:
            kc, vc = self.cache.flat(layer)
            kc.index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
            vc.index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        gqa = cfg.num_heads != cfg.num_kv_heads
        if len(meta.seqs) == 1 and meta.seqs[0].kv_index is None:
            s = meta.seqs[0]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=s.q_len > 1, scale=self.scale, enable_gqa=gqa,
            )
            return o[0].transpose(0, 1).reshape(t, cfg.q_size)
        out = torch.empty(t, cfg.num_heads, hd, dtype=q.dtype, device=q.device)
        for s in meta.seqs:
            qs = q[s.q_start:s.q_start + s.q_len]
            if s.kv_index is None:
                ks = k[s.q_start:s.q_start + s.q_len]
                vs = v[s.q_start:s.q_start + s.q_len]
            else:
                if self.cache is None:
                    raise ValueError("a sequence with cache slots (kv_index) needs the KV cache")
                kc, vc = self.cache.flat(layer)
                if s.kv_start is not None:
                    ks = kc[s.kv_start:s.kv_start + s.ctx_len].to(q.dtype)
                    vs = vc[s.kv_start:s.kv_start + s.ctx_len].to(q.dtype)
                else:
                    ks = kc.index_select(0, s.kv_index).to(q.dtype)
                    vs = vc.index_select(0, s.kv_index).to(q.dtype)
            if s.q_len == 1:
                out[s.q_start] = self._single_query(qs[0], ks, vs)
                continue
            causal = s.mask is None and s.q_len > 1 and s.q_len == s.ctx_len
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                attn_mask=s.mask, is_causal=causal, scale=self.scale, enable_gqa=gqa,
            )
            out[s.q_start:s.q_start + s.q_len] = o[0].transpose(0, 1)
        return out.view(t, cfg.q_size)

    def _single_query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One query [heads, hd] over keys/values [ctx, kv_heads, hd] (decode; CPU SDPA is slow here)."""
        nkv = k.shape[1]
        qg = q.view(nkv, -1, q.shape[-1])  # [kv, group, hd]
        scores = torch.bmm(qg, k.permute(1, 2, 0)) * self.scale  # [kv, group, ctx]
        probs = scores.float().softmax(dim=-1).to(v.dtype)
        return torch.bmm(probs, v.transpose(0, 1)).reshape(q.shape)  # [heads, hd]
