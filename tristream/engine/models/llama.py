"""Compact Llama-family decoder (Llama 2/3.x, SmolLM2, Qwen2/2.5) over packed token batches.

The model works on a flat batch of T tokens (all sequences of a step concatenated) and hands
attention to an `AttentionBackend`, which owns rope, the KV-cache writes and the attention
kernel: the torch reference (CPU, tests, GPU prefill) or the Triton/graph path (GPU decode).
q/k/v and gate/up projections are fused into one matrix each, so a layer is five GEMMs.
Embedding lookup is separate (`embed`) so callers may splice in precomputed embeddings
(vision tokens) before `forward`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tristream.engine.config import ModelConfig
from tristream.engine.linear import Linear
from tristream.engine.models.layers import Layers
from tristream.engine.rope import cos_sin_table


class AttentionBackend(Protocol):
    """Computes attention for one layer: rope, cache write and attention over the context."""

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:  # [T, q+2kv] -> [T, q]
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to the input dtype (as transformers does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class TorchOps:
    """Elementwise pieces of a layer in plain torch (CPU, prefill, reference)."""

    rms_norm = staticmethod(rms_norm)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        r = residual + x
        return rms_norm(r, w, eps), r

    @staticmethod
    def silu_mul(gu: torch.Tensor) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u


class LlamaLayer(nn.Module):
    """One decoder block's weights (fused qkv and gate_up)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        h = cfg.hidden_size
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.input_norm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.qkv = Linear(cfg.q_size + 2 * cfg.kv_size, h, bias=cfg.attention_bias, **kw)
        self.o = Linear(h, cfg.q_size, **kw)
        self.gate_up = Linear(2 * cfg.intermediate_size, h, **kw)
        self.down = Linear(h, cfg.intermediate_size, **kw)


class LlamaModel(nn.Module):
    """Weights and forward pass of a Llama-family decoder."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False)
        self.layers = Layers[LlamaLayer](LlamaLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw), requires_grad=False)
        self.lm_head: Linear | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.vocab_size, cfg.hidden_size, **kw)
        npos = min(cfg.max_position, max_positions or cfg.max_position)
        self.cos_sin: torch.Tensor
        self.register_buffer(
            "cos_sin", cos_sin_table(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, npos).to(device),
            persistent=False,
        )

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def head(self) -> Linear:
        """The output projection (the embedding matrix when tied)."""
        if self.lm_head is not None:
            return self.lm_head
        if not hasattr(self, "_tied_head"):
            self._tied_head = Linear.wrap(self.embed_tokens)
        return self._tied_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] → embeddings [T, hidden]."""
        return F.embedding(ids, self.embed_tokens)

    def forward(self, h: torch.Tensor, attention: AttentionBackend, ops: Any = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; attention owns positions and cache.

        `ops` supplies rms_norm / add_rms_norm / silu_mul (torch by default, Triton for GPU decode).
        """
        ops = ops or TorchOps
        eps = self.cfg.rms_norm_eps
        layers = self.layers
        residual = h
        x = ops.rms_norm(h, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            a = layer.o(attention(i, layer.qkv(x)))
            x, residual = ops.add_rms_norm(a, residual, layer.post_norm, eps)
            d = layer.down(ops.silu_mul(layer.gate_up(x)))
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else self.norm
            x, residual = ops.add_rms_norm(d, residual, nxt, eps)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for hidden states [N, hidden]."""
        return self.head()(h).float()
