"""Weight-only int8 quantisation of a model's projections (CPU decode speed)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tristream.engine.linear import Linear
from tristream.engine.models.llama import LlamaModel


def quantize_model_int8(model: LlamaModel, include_head: bool = True,
                        compute_dtype: torch.dtype = torch.bfloat16) -> None:
    """Give every projection (and the output head) an int8 weight with per-channel scales."""
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            lin.quantize_int8(compute_dtype)
    if include_head:
        model.head().quantize_int8(compute_dtype, keep_dense=model.lm_head is not None)


def keep_prefill_copies(model: LlamaModel) -> None:
    """bf16 copies of the layer projections for prefill (see Linear.keep_prefill_copy)."""
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            lin.keep_prefill_copy()


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


def _linears(model: LlamaModel) -> dict[str, Linear]:
    out: dict[str, Linear] = {}
    for i, layer in enumerate(model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            out[f"{i}.{name}"] = getattr(layer, name)
    out["head"] = model.head()
    return out


def _state(lin: Linear) -> dict[str, torch.Tensor]:
    if lin.q4 is not None and lin.q4_scales_zeros is not None:
        return {"q4": lin.q4, "sz": lin.q4_scales_zeros}
    if lin.qweight is not None and lin.scales is not None:
        return {"qw": lin.qweight, "sc": lin.scales}
    return {}


def quantize_model_cached(model: LlamaModel, mode: str, source: Path) -> None:
    """`quantize_model`, reusing quantised tensors cached for this checkpoint (fast second load)."""
    from safetensors.torch import load_file, save_file

    from tristream.engine.disk_cache import cache_root, content_key, prune, touch

    files = sorted(source.glob("*.safetensors"))
    key = content_key(files, mode, "quant-v2")
    path = cache_root() / "quant" / f"{key}.safetensors"
    lins = _linears(model)
    keep_prefill_copies(model)
    if path.exists():
        try:
            t = load_file(str(path))
            for name, lin in lins.items():
                if f"{name}.q4" in t:
                    lin.q4, lin.q4_scales_zeros = t[f"{name}.q4"], t[f"{name}.sz"]
                elif f"{name}.qw" in t:
                    lin.qweight, lin.scales = t[f"{name}.qw"], t[f"{name}.sc"]
                else:
                    raise KeyError(name)
                if name != "head" or model.lm_head is not None:
                    lin.weight = torch.nn.Parameter(torch.empty(0, dtype=lin.weight.dtype), requires_grad=False)
            touch(path)
            return
        except (KeyError, OSError, RuntimeError):
            pass  # stale or partial cache: quantise again below
    quantize_model(model, mode)
    tensors = {f"{name}.{k}": v.contiguous() for name, lin in lins.items() for k, v in _state(lin).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
    prune(path.parent, keep=path)
