"""VLM → LLM engine: the VLM's decoder as the engine's Llama, images into a context as embeddings.

`load_language_model` builds the engine's `LlamaModel` from a `VisionLanguageModel`'s text
weights; `append_images` puts projected image tokens into a session's context through the
engine's incremental prefill (`LLMEngine.append(embeddings=...)`), so vision tokens enter the KV
cache while the user is still speaking. Equal `cache_key`s (e.g. a frame hash) make repeated
images prefix-cache hits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tristream.vision.vlm import ImageTokens, VisionLanguageModel

if TYPE_CHECKING:
    from tristream.engine.models.llama import LlamaModel


def load_language_model(vlm: VisionLanguageModel, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", max_positions: int | None = None) -> LlamaModel:
    """The VLM's language model as the engine's `LlamaModel` (weights shared by value, not re-read)."""
    from tristream.engine.config import ModelConfig
    from tristream.engine.loader import assign_hf_weights
    from tristream.engine.models.llama import LlamaModel

    cfg = ModelConfig.from_hf(vlm.text_config)
    model = LlamaModel(cfg, dtype=dtype, device=device, max_positions=max_positions)
    state = vlm.text_state_dict()
    assign_hf_weights(model, state.__getitem__)
    return model


def append_images(engine: Any, seq_id: int, images: ImageTokens, cache_key: str | None = None) -> int:
    """Append all images' tokens (`[n_images * k, hidden]`) to a context; returns positions used."""
    flat = images.flat()
    engine.append(seq_id, embeddings=flat, cache_key=cache_key)
    return int(flat.shape[0])
