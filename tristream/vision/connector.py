"""Connectors that map vision features into an LLM's embedding space.

`LlavaProjector` is LLaVA's two-layer MLP over the features of one (or several concatenated)
tower layers; `PixelShuffleConnector` is Idefics3 / SmolVLM's space-to-depth shuffle (each
`scale x scale` patch group becomes one token) followed by one bias-free linear map.
"""

from __future__ import annotations

import torch
from torch import nn

from tristream.vision.errors import VisionWeightsError
from tristream.vision.vit import activation


class LlavaProjector(nn.Module):
    """linear → activation → linear, vision width × n_layers → text width."""

    def __init__(self, vision_dim: int, text_dim: int, act: str = "gelu", bias: bool = True) -> None:
        super().__init__()
        self.act = act
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)

    @property
    def group(self) -> int:
        """Vision tokens folded into one output token (1: LLaVA keeps every patch)."""
        return 1

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(activation(self.act, self.linear_1(features)))

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], prefix: str, act: str) -> LlavaProjector:
        """Load `<prefix>linear_1/2.{weight,bias}`."""
        try:
            w1, w2 = state[prefix + "linear_1.weight"], state[prefix + "linear_2.weight"]
        except KeyError:
            raise VisionWeightsError(f"no LLaVA projector weights under {prefix!r}") from None
        bias = prefix + "linear_1.bias" in state
        proj = cls(w1.shape[1], w1.shape[0], act, bias)
        sd = {"linear_1.weight": w1, "linear_2.weight": w2}
        if bias:
            sd["linear_1.bias"] = state[prefix + "linear_1.bias"]
            sd["linear_2.bias"] = state[prefix + "linear_2.bias"]
        proj.load_state_dict(sd)
        return proj


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[B, N, D] on a square grid → [B, N / scale², D · scale²], Idefics3's token order."""
    b, n, d = x.shape
    side = int(round(n**0.5))
    if side * side != n or side % scale:
        raise VisionWeightsError(f"pixel shuffle needs a square grid divisible by {scale}; got {n} tokens")
    x = x.reshape(b, side, side // scale, d * scale)
    x = x.permute(0, 2, 1, 3).reshape(b, side // scale, side // scale, d * scale * scale)
    return x.permute(0, 2, 1, 3).reshape(b, n // (scale * scale), d * scale * scale)


class PixelShuffleConnector(nn.Module):
    """Idefics3 / SmolVLM connector: pixel shuffle, then a bias-free projection."""

    def __init__(self, vision_dim: int, text_dim: int, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.proj = nn.Linear(vision_dim * scale * scale, text_dim, bias=False)

    @property
    def group(self) -> int:
        return self.scale * self.scale

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_shuffle(features, self.scale))

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], prefix: str, scale: int) -> PixelShuffleConnector:
        """Load `<prefix>modality_projection.proj.weight`."""
        key = prefix + "modality_projection.proj.weight"
        if key not in state:
            raise VisionWeightsError(f"no Idefics3 connector weight {key!r}")
        w = state[key]
        if w.shape[1] % (scale * scale):
            raise VisionWeightsError(f"connector input width {w.shape[1]} is not a multiple of scale² = {scale**2}")
        conn = cls(w.shape[1] // (scale * scale), w.shape[0], scale)
        conn.load_state_dict({"proj.weight": w})
        return conn

    def group_saliency(self, saliency: torch.Tensor) -> torch.Tensor:
        """Per-patch saliency [B, N] → per-output-token saliency [B, N / scale²] (sum over each group)."""
        return pixel_shuffle(saliency.unsqueeze(-1), self.scale).sum(-1)
