"""Attention-mass probe: per-position attention probabilities of a sequence's last position.

The GPU decode path (Triton paged attention inside CUDA graphs) never materialises attention
probabilities, so the retention policy cannot read them from decoding. Eviction is rare (once
per block of growth past the budget), so at eviction time we re-run the sequence's last
computed position eagerly: one single-token forward over the cached context (the same work as
one eager decode step, O(layers × context)), through an attention backend that reads K/V from
the paged cache, never writes it, and records softmax(q·K) averaged over heads and over the
last `layers` layers. The position's own K/V are read back from the cache, so the probe sees
exactly what decoding sees.
"""

from __future__ import annotations

import numpy as np
import torch

from tristream.engine.config import ModelConfig
from tristream.engine.kv_cache import KVCache
from tristream.engine.models.llama import LlamaModel
from tristream.engine.rope import apply_rope
from tristream.engine.sequence import Sequence


class ProbeError(ValueError):
    """The sequence has no computed position to probe."""


class ProbeAttention:
    """Read-only attention backend for one query: records its probabilities over the cache."""

    def __init__(self, cfg: ModelConfig, cos_sin: torch.Tensor, position: int, kv_slots: torch.Tensor,
                 cache: KVCache, dtype: torch.dtype, record: range) -> None:
        self.cfg = cfg
        self.cache = cache
        self.kv_slots = kv_slots
        half = cfg.head_dim // 2
        cs = cos_sin[position:position + 1].to(dtype)
        self.cos = cs[:, None, :half]
        self.sin = cs[:, None, half:]
        self.scale = cfg.head_dim ** -0.5
        self.record = record
        self.acc = torch.zeros(int(kv_slots.shape[0]), dtype=torch.float32, device=kv_slots.device)

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        hd, nkv = cfg.head_dim, cfg.num_kv_heads
        q = apply_rope(qkv[:, :cfg.q_size].view(1, cfg.num_heads, hd), self.cos, self.sin)
        kc, vc = self.cache.flat(layer)
        ks = kc.index_select(0, self.kv_slots).to(q.dtype)  # [ctx, kv_heads, hd]
        vs = vc.index_select(0, self.kv_slots).to(q.dtype)
        qg = q[0].view(nkv, -1, hd)  # [kv, group, hd]
        probs = (torch.bmm(qg, ks.permute(1, 2, 0)) * self.scale).float().softmax(dim=-1)  # [kv, group, ctx]
        if layer in self.record:
            self.acc += probs.mean(dim=(0, 1))
        return torch.bmm(probs.to(vs.dtype), vs.transpose(0, 1)).reshape(1, cfg.q_size)


def cache_slots(seq: Sequence, block_size: int) -> np.ndarray:
    """Flat cache slots of the sequence's cached positions, in cache order."""
    n = seq.cache_len
    nb = -(-n // block_size)
    bt = np.asarray(seq.block_table[:nb], dtype=np.int64)
    return (bt[:, None] * block_size + np.arange(block_size, dtype=np.int64)[None, :]).reshape(-1)[:n]


@torch.inference_mode()
def attention_probe(model: LlamaModel, cache: KVCache, seq: Sequence, layers: int | None = None) -> np.ndarray:
    """Attention probabilities [cache_len] of the sequence's last computed position over its cached
    positions (cache order), averaged over heads and the last `layers` layers (None: all).

    Leaves the cache untouched."""
    n = seq.cache_len
    if n <= 0:
        raise ProbeError(f"sequence {seq.seq_id} has no cached position to probe")
    cfg = model.cfg
    nl = cfg.num_layers if layers is None else max(1, min(layers, cfg.num_layers))
    last = seq.num_computed - 1
    mapped = seq.positions(last, last + 1, cache.block_size)  # None unless recomputing kept blocks
    pos = last if mapped is None else int(mapped[0])  # logical position of the probed query
    key = seq.keys[pos]
    h = model.embed(torch.tensor([max(key, 0)], dtype=torch.int64, device=model.device))
    if key < 0:
        for start, emb in seq.embeds:
            if start <= pos < start + emb.shape[0]:
                h[0] = emb[pos - start].to(device=h.device, dtype=h.dtype)
                break
    slots = torch.from_numpy(cache_slots(seq, cache.block_size)).to(model.device)
    attn = ProbeAttention(cfg, model.cos_sin, pos, slots, cache, model.dtype,
                          range(cfg.num_layers - nl, cfg.num_layers))
    model(h, attn)
    return (attn.acc / nl).cpu().numpy()
