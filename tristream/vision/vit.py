"""Compact ViT vision towers (SigLIP, CLIP, Idefics3/SmolVLM) that load Hugging Face weights.

One module covers the three families: they differ only in a class token (CLIP), a pre-norm
(CLIP), where the final LayerNorm applies (SigLIP/Idefics3: every token; CLIP: the pooled class
token), the activation and an optional attention-pooling head (SigLIP). The q/k/v projections are
fused into one matmul and attention goes through `scaled_dot_product_attention`, so the tower is
a short, graph-capturable chain of large kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tristream.vision.errors import VisionWeightsError

VISION_KINDS = ("siglip", "clip", "idefics3")


@dataclass(frozen=True, slots=True)
class VisionTowerConfig:
    """Shape and flavour of a ViT tower, read from an HF `vision_config`."""

    kind: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    use_head: bool = False

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def has_cls(self) -> bool:
        return self.kind == "clip"

    @property
    def seq_len(self) -> int:
        """Tokens through the encoder (patches plus a class token for CLIP)."""
        return self.num_patches + (1 if self.has_cls else 0)

    @classmethod
    def from_hf(cls, d: dict[str, Any], kind: str | None = None, use_head: bool | None = None) -> VisionTowerConfig:
        """Build from an HF vision config dict; `kind` defaults to its `model_type`."""
        mt = str(d.get("model_type", kind or "siglip"))
        if kind is None:
            if "clip" in mt:
                kind = "clip"
            elif "idefics3" in mt or "smolvlm" in mt:
                kind = "idefics3"
            elif "siglip" in mt:
                kind = "siglip"
            else:
                raise VisionWeightsError(
                    f"vision model_type {mt!r} is not supported; expected one of siglip/clip/idefics3 variants"
                )
        if kind not in VISION_KINDS:
            raise VisionWeightsError(f"vision kind {kind!r} is not one of {VISION_KINDS}")
        default_act = "quick_gelu" if kind == "clip" else "gelu_pytorch_tanh"
        default_eps = 1e-5 if kind == "clip" else 1e-6
        return cls(
            kind=kind,
            hidden_size=int(d.get("hidden_size", 768)),
            intermediate_size=int(d.get("intermediate_size", 3072)),
            num_layers=int(d.get("num_hidden_layers", 12)),
            num_heads=int(d.get("num_attention_heads", 12)),
            image_size=int(d.get("image_size", 224)),
            patch_size=int(d.get("patch_size", 16)),
            num_channels=int(d.get("num_channels", 3)),
            layer_norm_eps=float(d.get("layer_norm_eps", default_eps)),
            hidden_act=str(d.get("hidden_act", default_act)),
            use_head=bool(d.get("vision_use_head", True)) if (use_head is None and kind == "siglip")
            else bool(use_head),
        )


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The HF activation called `name`."""
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "relu":
        return F.relu(x)
    if name in ("silu", "swish"):
        return F.silu(x)
    raise VisionWeightsError(f"activation {name!r} is not supported")


def _attention_received(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Softmax attention probabilities of queries `q` over keys `k` (`[B, heads, *, N]`), averaged
    over heads and queries: what each key token receives ([B, N])."""
    p = torch.softmax((q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5), dim=-1)
    return p.mean(dim=(1, 2))


class _TowerBlock(nn.Module):
    """What the encoder layer and the pooling head hold: multi-head attention settings and,
    registered by the subclass after its own modules, the MLP (`fc1`, activation, `fc2`)."""

    fc1: nn.Linear
    fc2: nn.Linear

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.act = cfg.hidden_act

    def _add_mlp(self, cfg: VisionTowerConfig) -> None:
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of (normalised) `x`, before its residual add."""
        return self.fc2(activation(self.act, self.fc1(x)))


class TowerLayer(_TowerBlock):
    """Pre-norm transformer block with fused QKV."""

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__(cfg)
        d = cfg.hidden_size
        self.ln1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self._add_mlp(cfg)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, n, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self._qkv(x)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        return x + self._mlp(self.ln2(x))

    def attention_received(self, x: torch.Tensor, query_index: int | None = None) -> torch.Tensor:
        """Mean attention probability each token receives in this layer ([B, N]), heads averaged.

        With `query_index` only that query row counts (the CLS token of CLIP), else all queries.
        """
        q, k, _ = self._qkv(x)
        if query_index is not None:
            q = q[:, :, query_index : query_index + 1]
        return _attention_received(q, k)


class AttentionPoolHead(_TowerBlock):
    """SigLIP's multi-head attention pooling head (a learned probe attends over all patches)."""

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__(cfg)
        d = cfg.hidden_size
        self.probe = nn.Parameter(torch.zeros(1, 1, d))
        self.in_proj = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self._add_mlp(cfg)

    def _probe_qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, d = x.shape
        h = self.num_heads
        w, bias = self.in_proj.weight, self.in_proj.bias
        q = F.linear(self.probe.expand(b, 1, d), w[:d], bias[:d]).view(b, 1, h, d // h).transpose(1, 2)
        kv = F.linear(x, w[d:], bias[d:]).view(b, n, 2, h, d // h)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        q, k, v = self._probe_qk(x)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, 1, d)
        h = self.out(a)
        h = h + self._mlp(self.ln(h))
        return h[:, 0]

    def attention_received(self, x: torch.Tensor) -> torch.Tensor:
        """Probe attention over patches, heads averaged ([B, N])."""
        q, k, _ = self._probe_qk(x)
        return _attention_received(q, k)


@dataclass(slots=True)
class TowerOutput:
    """Features of one forward: the selected hidden state and, if asked, pooled output and saliency."""

    features: torch.Tensor
    pooled: torch.Tensor | None = None
    saliency: torch.Tensor | None = None


class VisionTower(nn.Module):
    """A SigLIP / CLIP / Idefics3 ViT. `forward` returns `[B, N, D]` features of one layer."""

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.patch = nn.Conv2d(cfg.num_channels, d, cfg.patch_size, cfg.patch_size, bias=cfg.kind != "clip")
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, d))
        self.cls = nn.Parameter(torch.zeros(d)) if cfg.has_cls else None
        self.pre_ln = nn.LayerNorm(d, eps=cfg.layer_norm_eps) if cfg.kind == "clip" else None
        self.layers = nn.ModuleList(TowerLayer(cfg) for _ in range(cfg.num_layers))
        self.post_ln = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.head = AttentionPoolHead(cfg) if cfg.use_head else None

    def resolve_layer(self, layer: int) -> int:
        """HF `hidden_states` index (0 = embeddings, negative from the end) → layers to run."""
        n = self.cfg.num_layers
        idx = layer if layer >= 0 else n + 1 + layer
        if not 0 <= idx <= n:
            raise VisionWeightsError(f"feature layer {layer} is outside 0..{n} (or -1..-{n + 1})")
        return idx

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """Patch + position embeddings (and CLIP's class token and pre-norm)."""
        x = self.patch(pixels).flatten(2).transpose(1, 2)
        if self.cls is not None:
            x = torch.cat([self.cls.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.pos.to(x.dtype)
        if self.pre_ln is not None:
            x = self.pre_ln(x)
        return x

    def forward(
        self,
        pixels: torch.Tensor,
        layer: int | None = None,
        saliency: str | None = None,
    ) -> TowerOutput:
        """Run the tower on `[B, C, H, W]` pixels.

        `layer=None` gives the model's own last hidden state (post-norm for SigLIP/Idefics3, as HF's
        `last_hidden_state`) and the pooled output; an int gives HF's `hidden_states[layer]`, running
        only the layers needed. `saliency` is None, "norm" (feature L2 norm) or "attention" (attention
        received in the last layer run: the CLS row for CLIP, the head's probe for SigLIP, else all
        queries) and is `[B, N]` over the returned tokens.
        """
        if pixels.shape[-1] != self.cfg.image_size or pixels.shape[-2] != self.cfg.image_size:
            raise VisionWeightsError(
                f"pixels are {tuple(pixels.shape[-2:])}; this tower takes {self.cfg.image_size}x"
                f"{self.cfg.image_size} (resize with FramePreprocessor)"
            )
        n_run = self.cfg.num_layers if layer is None else self.resolve_layer(layer)
        x = self.embed(pixels)
        sal: torch.Tensor | None = None
        for i in range(n_run):
            blk = cast(TowerLayer, self.layers[i])
            if saliency == "attention" and i == n_run - 1 and (self.head is None or layer is not None):
                sal = blk.attention_received(x, 0 if self.cfg.has_cls else None)
            x = blk(x)
        pooled: torch.Tensor | None = None
        if layer is None:
            if self.cfg.kind == "clip":
                pooled = self.post_ln(x[:, 0])
            else:
                x = self.post_ln(x)
                if self.head is not None:
                    if saliency == "attention":
                        sal = cast(AttentionPoolHead, self.head).attention_received(x)
                    pooled = self.head(x)
        if saliency == "norm":
            sal = x.float().norm(dim=-1)
        elif saliency == "attention" and sal is None:
            raise VisionWeightsError("attention saliency needs at least one encoder layer")
        elif saliency not in (None, "norm", "attention"):
            raise VisionWeightsError(f"saliency {saliency!r} is not one of None, 'norm', 'attention'")
        return TowerOutput(features=x, pooled=pooled, saliency=sal)


def _find_prefix(keys: list[str], suffix: str) -> str:
    hits = sorted((k[: -len(suffix)] for k in keys if k.endswith(suffix)), key=len)
    if not hits:
        raise VisionWeightsError(f"no weight ending in {suffix!r}: is this a vision tower checkpoint?")
    return hits[0]


def load_vision_tower(
    cfg: VisionTowerConfig, state: dict[str, torch.Tensor], prefix: str | None = None
) -> VisionTower:
    """Build a tower and fill it from an HF state dict (any prefix, found if not given)."""
    keys = list(state)
    if prefix is None:
        prefix = _find_prefix(keys, "embeddings.patch_embedding.weight")
    p = prefix
    tower = VisionTower(cfg)
    sd: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        try:
            return state[p + name]
        except KeyError:
            raise VisionWeightsError(f"missing weight {p + name!r} for a {cfg.kind} tower") from None

    sd["patch.weight"] = take("embeddings.patch_embedding.weight")
    if cfg.kind != "clip":
        sd["patch.bias"] = take("embeddings.patch_embedding.bias")
    sd["pos"] = take("embeddings.position_embedding.weight")
    if cfg.kind == "clip":
        sd["cls"] = take("embeddings.class_embedding")
        sd["pre_ln.weight"] = take("pre_layrnorm.weight")
        sd["pre_ln.bias"] = take("pre_layrnorm.bias")
    for i in range(cfg.num_layers):
        lp = f"encoder.layers.{i}."
        o = f"layers.{i}."
        for ours, theirs in (("ln1", "layer_norm1"), ("ln2", "layer_norm2"), ("out", "self_attn.out_proj"),
                             ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
            sd[o + ours + ".weight"] = take(lp + theirs + ".weight")
            sd[o + ours + ".bias"] = take(lp + theirs + ".bias")
        sd[o + "qkv.weight"] = torch.cat([take(lp + f"self_attn.{n}_proj.weight") for n in "qkv"])
        sd[o + "qkv.bias"] = torch.cat([take(lp + f"self_attn.{n}_proj.bias") for n in "qkv"])
    post = "post_layernorm."
    sd["post_ln.weight"] = take(post + "weight")
    sd["post_ln.bias"] = take(post + "bias")
    if cfg.use_head:
        h = "head."
        sd["head.probe"] = take(h + "probe")
        sd["head.in_proj.weight"] = take(h + "attention.in_proj_weight")
        sd["head.in_proj.bias"] = take(h + "attention.in_proj_bias")
        sd["head.out.weight"] = take(h + "attention.out_proj.weight")
        sd["head.out.bias"] = take(h + "attention.out_proj.bias")
        sd["head.ln.weight"] = take(h + "layernorm.weight")
        sd["head.ln.bias"] = take(h + "layernorm.bias")
        for n in ("fc1", "fc2"):
            sd[f"head.{n}.weight"] = take(f"{h}mlp.{n}.weight")
            sd[f"head.{n}.bias"] = take(f"{h}mlp.{n}.bias")
    tower.load_state_dict(sd, strict=True)
    return tower
