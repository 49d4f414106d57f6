"""Weight-only int8 quantisation of a model's projections (CPU decode speed)."""

from __future__ import annotations

import torch

from tristream.engine.models.llama import LlamaModel


def quantize_model_int8(model: LlamaModel, include_head: bool = True,
                        compute_dtype: torch.dtype = torch.bfloat16) -> None:
    """Give every projection (and the output head) an int8 weight with per-channel scales."""
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            lin.quantize_int8(compute_dtype)
    if include_head:
        model.head().quantize_int8(compute_dtype, keep_dense=model.lm_head is not None)


def quantize_model(model: LlamaModel, mode: str) -> None:
    """Weight-only quantisation for CPU decode: 'int8' (per channel) or 'int4' (groups of 32;
    the output head stays int8, as GGUF files keep their embeddings at 8 bits)."""
    if mode == "int8":
        quantize_model_int8(model)
        return
    if mode != "int4":
        raise ValueError(f"quantisation mode must be int8 or int4, not {mode!r}")
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            lin.quantize_int4()
    model.head().quantize_int8(keep_dense=model.lm_head is not None)
