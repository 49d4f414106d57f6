"""Weight-only quantisation of a model's projections.

CPU modes (native block kernels): 'int4' (q4 blocks for the layer projections, q8 for the
output head, as GGUF files keep their embeddings at 8 bits) and 'int8' (q8 everywhere).
`linear.py` has the formats; the kernels are in `tristream/engine/cpu/`.

GPU mode 'fp8': every projection and the output head as e4m3 codes with a float32 scale per
output row (`linear.quantize_fp8`), run by `kernels/fp8_gemv.py`; activations stay bf16. It is
quantised at load on the device (no disk cache: a few milliseconds per layer there). FP8
checkpoints (float8_e4m3fn weights with `weight_scale` / `weight_scale_inv` tensors) load
without re-quantising where their scales are per tensor or per row (`fp8_checkpoint_weights`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tristream.engine.linear import Linear
from tristream.engine.models.llama import LlamaModel

MODES = ("int8", "int4", "fp8")
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


def is_fp8(model: LlamaModel) -> bool:
    """Whether the model's layer projections hold e4m3 weights."""
    return bool(model.layers) and model.layers[0].qkv.qformat == "fp8"


def quantize_model_fp8(model: LlamaModel, head: bool = False, tune: bool = True) -> None:
    """Every layer projection (and the output head with head=True) to e4m3 with row scales, in
    place. The head stays bf16 by default: in e4m3 it cost SmolLM2-135M 5.9 % perplexity, against
    0.97 % with it in bf16 (`bench/llm.py --fp8-quality`, `bench/results/llm_gpu_fp8_8b.json`). A tied head keeps the dense embedding for lookups. On CUDA (tune=True) the kernels are
    then timed per shape (`kernels.fp8_tune.tune_model`; the report in `model.fp8_tuning`)."""
    for name, lin in _projections(model).items():
        if name == "head" and not head:
            continue
        if lin.qformat == "fp8":
            continue
        lin.quantize_fp8(keep_dense=lin is model.head() and model.lm_head is None)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
        if tune:
            from tristream.engine.kernels.fp8_tune import tune_model

            setattr(model, "fp8_tuning", tune_model(model))  # noqa: B010 (no such field on LlamaModel)


def quantize_model(model: LlamaModel, mode: str) -> None:
    """Quantise every projection and the output head in place (`MODES`)."""
    check_mode(mode)
    if mode == "fp8":
        quantize_model_fp8(model)
        return
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
    if mode == "fp8":
        quantize_model_fp8(model)  # fast on the device; nothing cached
        return
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


_FP8_SUFFIXES = ("weight_scale", "weight_scale_inv")


def fp8_checkpoint(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a checkpoint's tensors hold float8_e4m3fn weights."""
    return any(v.dtype == torch.float8_e4m3fn for v in tensors.values())


def fp8_row_scales(name: str, q: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The float32 scale per output row of the e4m3 weight `name` [N, K] from its scale tensor
    (`<prefix>.weight_scale` or `.weight_scale_inv`: w = code · scale either way): a scalar or
    one per row ([N] or [N, 1]) gives rows exactly; blocks ([ceil(N/b), ceil(K/b)]) give None."""
    prefix = name.removesuffix(".weight")
    s = next((tensors[f"{prefix}.{x}"] for x in _FP8_SUFFIXES if f"{prefix}.{x}" in tensors), None)
    if s is None:
        raise KeyError(f"fp8 weight {name!r} has no {prefix}.weight_scale in the checkpoint")
    n = q.shape[0]
    s = s.float()
    if s.numel() == 1:
        return s.reshape(1).expand(n).contiguous()
    if s.numel() == n and (s.dim() == 1 or s.shape[-1] == 1):
        return s.reshape(n).contiguous()
    return None


def fp8_dequantize_tensor(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 value of checkpoint tensor `name`: e4m3 weights times their scales (per
    tensor, per row or per block), anything else as stored."""
    t = tensors[name]
    if t.dtype != torch.float8_e4m3fn:
        return t
    rows = fp8_row_scales(name, t, tensors)
    if rows is not None:
        return t.float() * rows[:, None]
    prefix = name.removesuffix(".weight")
    s = next(tensors[f"{prefix}.{x}"] for x in _FP8_SUFFIXES if f"{prefix}.{x}" in tensors).float()
    n, k = t.shape
    bn, bk = -(-n // s.shape[0]), -(-k // s.shape[1])
    full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return t.float() * full


def install_fp8_checkpoint(model: LlamaModel, tensors: dict[str, torch.Tensor]) -> int:
    """Give every projection whose checkpoint weights are e4m3 with per-tensor or per-row scales
    those codes exactly (q|k|v and gate|up concatenated as the model fuses them); projections
    with block scales are re-quantised per row from their dequantised values (already loaded
    into the model). Returns how many projections took the checkpoint's codes."""
    def parts(p: str, names: tuple[str, ...]) -> list[str]:
        return [f"{p}{n}.weight" for n in names]

    groups: dict[str, list[str]] = {}
    for i in range(len(model.layers)):
        p = f"model.layers.{i}."
        groups[f"{i}.qkv"] = parts(p + "self_attn.", ("q_proj", "k_proj", "v_proj"))
        groups[f"{i}.o"] = parts(p + "self_attn.", ("o_proj",))
        groups[f"{i}.gate_up"] = parts(p + "mlp.", ("gate_proj", "up_proj"))
        groups[f"{i}.down"] = parts(p + "mlp.", ("down_proj",))
    if model.lm_head is not None:
        groups["head"] = ["lm_head.weight"]
    lins = _projections(model)
    exact = 0
    for key, names in groups.items():
        lin = lins[key]
        if not all(n in tensors and tensors[n].dtype == torch.float8_e4m3fn for n in names):
            continue
        scales = [fp8_row_scales(n, tensors[n], tensors) for n in names]
        if all(s is not None for s in scales):
            dev = model.device
            q = torch.cat([tensors[n].to(dev) for n in names])
            s = torch.cat([x.to(dev) for x in scales if x is not None])
            lin.set_fp8(q, s)
            exact += 1
        else:
            lin.quantize_fp8()
    if model.device.type == "cuda":
        from tristream.engine.kernels.fp8_tune import tune_model

        setattr(model, "fp8_tuning", tune_model(model))  # noqa: B010
    return exact
