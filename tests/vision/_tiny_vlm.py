"""Tiny random HF VLMs (LLaVA with a SigLIP or CLIP tower, Idefics3), saved to a folder for our loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models import randomise

TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
IMAGE_TOKEN = 300


def vision(layers: int) -> dict[str, int]:
    """A 32 px tower of 8 px patches (16 patches), `layers` deep."""
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                image_size=32, patch_size=8)


def saved_vlm(transformers: Any, path: Path, arch: str, layers: int, seed: int, scale: float,
              tower: str = "siglip", **llava: Any) -> torch.nn.Module:
    """An HF `arch` ("llava" or "idefics3") model with random weights, saved at `path`; `llava`:
    LlavaConfig options (vision_feature_select_strategy, vision_feature_layer)."""
    text = transformers.LlamaConfig(**TEXT).to_dict()
    if arch == "llava":
        vc = (transformers.CLIPVisionConfig if tower == "clip" else transformers.SiglipVisionConfig)(**vision(layers))
        cfg = transformers.LlavaConfig(vision_config=vc.to_dict(), text_config=text, image_token_index=IMAGE_TOKEN, **llava)
        ref = transformers.LlavaForConditionalGeneration(cfg).eval()
    else:
        cfg = transformers.Idefics3Config(vision_config=vision(layers), text_config=text, image_token_id=IMAGE_TOKEN,
                                          scale_factor=2)
        ref = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    randomise(ref, seed, scale)
    ref.save_pretrained(path)
    return ref
