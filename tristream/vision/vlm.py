"""Vision side of a VLM folder (LLaVA, Idefics3 / SmolVLM): tower + connector + prompt merge.

`VisionLanguageModel.from_folder` reads an HF checkpoint of `LlavaForConditionalGeneration` or
`Idefics3ForConditionalGeneration` / `SmolVLMForConditionalGeneration`, builds our tower and
connector, and keeps the language model's weights under plain Llama names (`model.*`,
`lm_head.weight`) with its HF text config, so the LLM engine loads them as a Llama. Images
become `[n_tokens, hidden]` embeddings that enter a session's context through the engine's
prefill-with-embeddings (or `merge` into a prompt's embeddings for a one-shot forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from tristream.vision.connector import LlavaProjector, PixelShuffleConnector
from tristream.vision.errors import VisionInputError, VisionWeightsError
from tristream.vision.pruning import keep_count, prune_tokens
from tristream.vision.vit import TowerLayer, VisionTower, VisionTowerConfig, load_vision_tower
from tristream.vision.weights import read_config, read_safetensors

_LLAVA = ("LlavaForConditionalGeneration",)
_IDEFICS3 = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
# Text-model prefixes of the HF checkpoint layouts we accept (legacy and transformers-5 style).
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.", "model.text_model.")
_HEAD_KEYS = ("language_model.lm_head.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class VlmSpec:
    """What the VLM's config says about images: arch, image token, feature layers, strategy."""

    arch: str
    image_token_id: int
    feature_layers: tuple[int, ...]
    select_strategy: str
    projector_act: str
    scale_factor: int
    text_config: dict[str, Any] = field(hash=False, compare=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> VlmSpec:
        archs = cfg.get("architectures") or []
        mt = str(cfg.get("model_type", ""))
        if any(a in _LLAVA for a in archs) or mt == "llava":
            arch = "llava"
        elif any(a in _IDEFICS3 for a in archs) or mt in ("idefics3", "smolvlm"):
            arch = "idefics3"
        else:
            raise VisionWeightsError(
                f"architectures {archs} / model_type {mt!r} is not a supported VLM "
                "(LlavaForConditionalGeneration, Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration)"
            )
        layer = cfg.get("vision_feature_layer", -2)
        layers = tuple(int(x) for x in layer) if isinstance(layer, list | tuple) else (int(layer),)
        tok = cfg.get("image_token_id", cfg.get("image_token_index"))
        if tok is None:
            raise VisionWeightsError("config has no image_token_id / image_token_index")
        text = dict(cfg.get("text_config") or {})
        text.setdefault("model_type", "llama")
        text.setdefault("architectures", ["LlamaForCausalLM"])
        if "tie_word_embeddings" in cfg:
            text.setdefault("tie_word_embeddings", cfg["tie_word_embeddings"])
        return cls(
            arch=arch,
            image_token_id=int(tok),
            feature_layers=layers,
            select_strategy=str(cfg.get("vision_feature_select_strategy", "default")),
            projector_act=str(cfg.get("projector_hidden_act", "gelu")),
            scale_factor=int(cfg.get("scale_factor", 2)),
            text_config=text,
        )


@dataclass(slots=True)
class ImageTokens:
    """Projected image tokens `[n_images, k, hidden]` and kept patch positions `[n_images, k]`."""

    embeds: torch.Tensor
    index: torch.Tensor
    dropped: int = 0

    def flat(self) -> torch.Tensor:
        """All images' tokens as one `[n_images * k, hidden]` block (prefill order)."""
        return self.embeds.reshape(-1, self.embeds.shape[-1])


class VisionLanguageModel(nn.Module):
    """Tower + connector + token embeddings of a VLM; the decoder weights are exposed for the LLM engine."""

    def __init__(self, spec: VlmSpec, tower: VisionTower, connector: nn.Module,
                 embed_tokens: torch.Tensor, text_state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.spec = spec
        self.tower = tower
        self.connector = connector
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens, freeze=True)
        self._text_state = text_state

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_state(cls, cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> VisionLanguageModel:
        """Build from a config dict and a full HF state dict."""
        spec = VlmSpec.from_hf(cfg)
        vcfg_d = dict(cfg.get("vision_config") or {})
        if spec.arch == "idefics3":
            vcfg = VisionTowerConfig.from_hf(vcfg_d, kind="idefics3", use_head=False)
        else:
            vcfg = VisionTowerConfig.from_hf(vcfg_d, use_head=False)
        tower = load_vision_tower(vcfg, state)
        connector: nn.Module
        if spec.arch == "llava":
            pfx = next((p for p in ("multi_modal_projector.", "model.multi_modal_projector.")
                        if p + "linear_1.weight" in state), None)
            if pfx is None:
                raise VisionWeightsError("LLaVA checkpoint has no multi_modal_projector weights")
            connector = LlavaProjector.from_state(state, pfx, spec.projector_act)
        else:
            pfx = next((p for p in ("model.connector.", "connector.")
                        if p + "modality_projection.proj.weight" in state), "model.connector.")
            connector = PixelShuffleConnector.from_state(state, pfx, spec.scale_factor)
        text: dict[str, torch.Tensor] = {}
        for k, v in state.items():
            for p in _TEXT_PREFIXES:
                if k.startswith(p):
                    text["model." + k[len(p):]] = v
        for hk in _HEAD_KEYS:
            if hk in state:
                text["lm_head.weight"] = state[hk]
        if "model.embed_tokens.weight" not in text:
            raise VisionWeightsError("no language-model embed_tokens weight found in the checkpoint")
        text.setdefault("lm_head.weight", text["model.embed_tokens.weight"])
        return cls(spec, tower, connector, text["model.embed_tokens.weight"], text)

    @classmethod
    def from_folder(cls, folder: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> VisionLanguageModel:
        """Load an HF VLM folder (config.json + safetensors)."""
        m = cls.from_state(read_config(folder), read_safetensors(folder))
        return m.to(device=device, dtype=dtype)

    def text_state_dict(self) -> dict[str, torch.Tensor]:
        """Language-model weights under `LlamaForCausalLM` names (`model.*`, `lm_head.weight`)."""
        return dict(self._text_state)

    @property
    def text_config(self) -> dict[str, Any]:
        """HF config dict of the language model (a Llama)."""
        return dict(self.spec.text_config)

    # ---- images --------------------------------------------------------------------------
    def patch_tokens(self) -> int:
        """Tokens per image before pruning."""
        n = self.tower.cfg.num_patches
        if self.spec.arch == "llava":
            return n + (1 if self.tower.cfg.has_cls and self.spec.select_strategy != "default" else 0) - (
                1 if self.spec.select_strategy == "default" and not self.tower.cfg.has_cls else 0)
        return n // (self.spec.scale_factor**2)

    def tokens_per_image(self, keep_ratio: float = 1.0) -> int:
        """Tokens per image that enter the LLM at `keep_ratio`."""
        return keep_count(self.patch_tokens(), keep_ratio)

    def _llava_features(self, pixels: torch.Tensor, saliency: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = self.tower
        want = [t.resolve_layer(x) for x in self.spec.feature_layers]
        n_run = max(want)
        x = t.embed(pixels)
        states = {0: x}
        sal: torch.Tensor | None = None
        for i in range(n_run):
            blk = cast(TowerLayer, t.layers[i])
            if saliency == "attention" and i == n_run - 1:
                sal = blk.attention_received(x, 0 if t.cfg.has_cls else None)
            x = blk(x)
            states[i + 1] = x
        feats = torch.cat([states[i] for i in want], dim=-1)
        if saliency == "norm":
            sal = states[want[-1]].float().norm(dim=-1)
        elif saliency == "attention" and sal is None:
            sal = states[0].float().norm(dim=-1)
        if self.spec.select_strategy == "default":
            feats = feats[:, 1:]
            sal = sal[:, 1:] if sal is not None else None
        return feats, sal

    def encode_images(self, pixels: torch.Tensor, keep_ratio: float = 1.0,
                      saliency: str = "norm") -> ImageTokens:
        """`[n, 3, S, S]` normalised pixels → LLM-space tokens, pruned to `keep_ratio` by `saliency`."""
        if pixels.dim() != 4:
            raise VisionInputError(f"pixels must be [n_images, 3, H, W]; got {tuple(pixels.shape)}")
        want_sal = saliency if keep_ratio < 1.0 else None
        if self.spec.arch == "llava":
            feats, sal = self._llava_features(pixels, want_sal)
        else:
            out = self.tower(pixels, layer=None, saliency=want_sal)
            feats, sal = out.features, out.saliency
        emb = self.connector(feats)
        if sal is None:
            idx = torch.arange(emb.shape[1], device=emb.device).expand(emb.shape[0], -1)
            return ImageTokens(emb, idx)
        if isinstance(self.connector, PixelShuffleConnector):
            sal = self.connector.group_saliency(sal)
        p = prune_tokens(emb, sal, keep_ratio)
        return ImageTokens(p.tokens, p.index, p.dropped)

    # ---- prompts -------------------------------------------------------------------------
    def expand_image_tokens(self, ids: list[int], tokens_per_image: int) -> list[int]:
        """Replace each single image token of `ids` by `tokens_per_image` copies."""
        out: list[int] = []
        for t in ids:
            out.extend([t] * tokens_per_image if t == self.spec.image_token_id else [t])
        return out

    def merge(self, input_ids: torch.Tensor, images: ImageTokens | torch.Tensor) -> torch.Tensor:
        """Token embeddings of `input_ids` ([T] or [B, T]) with image tokens replaced by image embeddings."""
        emb = self.embed_tokens(input_ids)
        img = images.flat() if isinstance(images, ImageTokens) else images.reshape(-1, emb.shape[-1])
        mask = input_ids == self.spec.image_token_id
        n = int(mask.sum())
        if n != img.shape[0]:
            raise VisionInputError(
                f"prompt has {n} image tokens but the images give {img.shape[0]} embeddings; "
                "expand each image placeholder with expand_image_tokens(ids, tokens_per_image(keep_ratio))"
            )
        return emb.masked_scatter(mask.unsqueeze(-1), img.to(emb.dtype))
