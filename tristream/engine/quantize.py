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
