"""Tiny random Llama/Qwen2 checkpoints saved in Hugging Face layout for engine tests."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tristream.engine.models.llama import LlamaModel


def tiny_hf_model(kind: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    """Create, save and return a tiny random transformers model ('llama', 'llama3', 'qwen2')."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
    )
    model: torch.nn.Module
    if kind == "qwen2":
        cfg = Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random non-zero biases so the bias path is exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    else:
        extra: dict = {"rope_theta": 10000.0, "tie_word_embeddings": False}
        if kind == "llama3":
            extra["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
            extra["rope_theta"] = 500000.0
        cfg = LlamaConfig(**common, **extra)
        model = LlamaForCausalLM(cfg)
    model = model.float().eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def random_llama_cuda(dtype: torch.dtype, num_layers: int = 4, attention_bias: bool = False) -> LlamaModel:
    """A SmolLM2-135M-shaped model with `num_layers` layers and seeded random weights on CUDA
    (norm weights around 1), for the GPU tests of kernels, graphs and prefill paths."""
    import dataclasses

    from tristream.engine.config import preset
    from tristream.engine.models.llama import LlamaModel

    cfg = dataclasses.replace(preset("smollm2-135m"), num_layers=num_layers, attention_bias=attention_bias)
    m = LlamaModel(cfg, dtype=dtype, device="cuda", max_positions=2048)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05 if p.dim() == 2 else 0.3, generator=g)
            if p.dim() == 1:
                p.add_(1.0)
    return m
