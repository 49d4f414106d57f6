"""Weight-only quantisation of a model's projections for CPU inference (native block kernels).

Modes: 'int4' (q4 blocks for the layer projections, q8 for the output head, as GGUF files keep
their embeddings at 8 bits) and 'int8' (q8 everywhere). `linear.py` has the formats; the
kernels are in `tristream/engine/cpu/`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tristream.engine.linear import Linear
from tristream.engine.models.llama import LlamaModel

MODES = ("int8", "int4")
_CACHE_FORMAT = "blocks-v3"


class QuantUnavailable(RuntimeError):
    """Quantised weights were asked for where the native CPU kernels cannot run."""


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"quantisation mode must be one of {', '.join(MODES)}, not {mode!r}")


def _projections(model: LlamaModel) -> dict[str, Linear]:
    """Every projection by name ('3.gate_up', ..., 'head')."""
    out = {f"{i}.{name}": getattr(layer, name) for i, layer in enumerate(model.layers)
           for name in ("qkv", "o", "gate_up", "down")}
    out["head"] = model.head()
    return out


def _formats(model: LlamaModel, mode: str) -> dict[str, tuple[Linear, str]]:
    """Each projection with the block format `mode` gives it (the head is always q8)."""
    layer_fmt = "q4" if mode == "int4" else "q8"
    return {name: (lin, "q8" if name == "head" else layer_fmt) for name, lin in _projections(model).items()}


def keep_prefill_copies(model: LlamaModel, dtype: torch.dtype = torch.bfloat16) -> None:
    """Dense copies of the layer projections for prefill (see Linear.keep_prefill_copy)."""
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            lin.keep_prefill_copy(dtype)


def quantize_model(model: LlamaModel, mode: str) -> None:
    """Quantise every projection and the output head in place (`MODES`)."""
    check_mode(mode)
    for lin, fmt in _formats(model, mode).values():
        lin.quantize(fmt, keep_dense=lin is model.head() and model.lm_head is None)


def pack_weights(model: LlamaModel) -> bool:
    """Move every quantised tensor into one block on huge pages (fewer TLB misses per token).
    Returns False (and changes nothing) where the native kernels are unavailable."""
    from tristream.engine.cpu.native import HugeBuffer
    from tristream.engine.linear import native_kernels

    kern = native_kernels()
    lins = [lin for lin in _projections(model).values() if lin.qformat is not None]
    if kern is None or not lins or os.environ.get("TRISTREAM_HUGE_PAGES") == "0":
        return False
    total = sum((t.numel() * t.element_size() + 63) // 64 * 64 for lin in lins for t in lin.qtensors.values())
    buf = HugeBuffer(kern, total)
    for lin in lins:
        lin.qtensors = {k: buf.take(v) for k, v in lin.qtensors.items()}
    return True


def quantize_model_cached(model: LlamaModel, mode: str, source: Path) -> None:
    """`quantize_model`, reusing the quantised tensors cached for this checkpoint (fast second load).

    The cached formats do not depend on the instruction set: the same file serves AVX2 and
    AVX-512 machines (and is checked for shape on load).
    """
    from safetensors.torch import load_file, save_file

    from tristream.engine.disk_cache import cache_root, content_key, prune, touch

    check_mode(mode)
    if source.parent == cache_root() / "gguf":  # a converted GGUF: its folder is named by the file's contents
        key = content_key([], source.name, mode, _CACHE_FORMAT)
    else:
        key = content_key(sorted(source.glob("*.safetensors")), mode, _CACHE_FORMAT)
    path = cache_root() / "quant" / f"{key}.safetensors"
    lins = _formats(model, mode)
    head_shared = model.lm_head is None
    if path.exists():
        try:
            grouped: dict[str, dict[str, torch.Tensor]] = {}
            for k, v in load_file(str(path)).items():
                prefix, part = k.rsplit(".", 1)
                grouped.setdefault(prefix, {})[part] = v
            for name, (lin, fmt) in lins.items():
                parts = grouped.get(f"{name}.{fmt}", {})
                rows = parts["w"].shape[0] if "w" in parts else -1
                if rows != lin.out_features:
                    raise KeyError(name)
                lin.set_quantized(fmt, parts, keep_dense=lin is model.head() and head_shared)
            touch(path)
            pack_weights(model)
            return
        except (KeyError, OSError, RuntimeError, ValueError):
            pass  # stale or partial cache: quantise again below
    quantize_model(model, mode)
    tensors = {f"{name}.{fmt}.{k}": v for name, (lin, fmt) in lins.items() for k, v in lin.qtensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
    prune(path.parent, keep=path)
    pack_weights(model)
