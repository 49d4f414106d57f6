"""Load Llama-family weights from Hugging Face folders (config.json + safetensors, sharded too).

`load_model(path)` accepts a folder or a `.gguf` file (see `gguf_loader`). Weights are
copied into the fused layout of `LlamaModel` (q|k|v and gate|up concatenated). A checkpoint
with float8_e4m3fn weights and their scale tensors loads as an fp8 model (`quantize.py`). `save_hf`
writes a model back in Hugging Face layout, which is how dequantised GGUF weights are cached.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from tristream.engine.config import ModelConfig
from tristream.engine.models.llama import LlamaModel


class WeightsNotFound(FileNotFoundError):
    """The path holds no loadable checkpoint."""


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsNotFound(f"{folder} has no *.safetensors files (and no model.safetensors.index.json)")
    return files


def read_safetensors(folder: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, memory-mapped where possible."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(folder):
        with safe_open(str(f), framework="pt", device=str(device)) as fh:
            for name in fh.keys():
                out[name] = fh.get_tensor(name)
    return out


def assign_hf_weights(model: LlamaModel, get: Callable[[str], torch.Tensor]) -> None:
    """Copy Hugging Face-named tensors into the fused layout of `model`."""
    cfg = model.cfg

    def put(dst: torch.Tensor, src: torch.Tensor) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"weight shape {tuple(src.shape)} does not match the model's {tuple(dst.shape)}")
        dst.copy_(src)

    with torch.no_grad():
        put(model.embed_tokens, get("model.embed_tokens.weight"))
        put(model.norm, get("model.norm.weight"))
        if model.lm_head is not None:
            put(model.lm_head.weight, get("lm_head.weight"))
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            put(layer.input_norm, get(p + "input_layernorm.weight"))
            put(layer.post_norm, get(p + "post_attention_layernorm.weight"))
            put(layer.qkv.weight, torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if cfg.attention_bias:
                assert layer.qkv.bias is not None
                put(layer.qkv.bias, torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            put(layer.o.weight, get(p + "self_attn.o_proj.weight"))
            put(layer.gate_up.weight, torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
            put(layer.down.weight, get(p + "mlp.down_proj.weight"))


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (unfused)."""
    cfg = model.cfg
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens.data,
        "model.norm.weight": model.norm.data,
    }
    if model.lm_head is not None:
        sd["lm_head.weight"] = model.lm_head.weight.data
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = layer.input_norm.data
        sd[p + "post_attention_layernorm.weight"] = layer.post_norm.data
        q, k, v = layer.qkv.weight.data.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"] = q, k, v
        if layer.qkv.bias is not None:
            qb, kb, vb = layer.qkv.bias.data.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            sd[p + "self_attn.q_proj.bias"], sd[p + "self_attn.k_proj.bias"], sd[p + "self_attn.v_proj.bias"] = qb, kb, vb
        sd[p + "self_attn.o_proj.weight"] = layer.o.weight.data
        g, u = layer.gate_up.weight.data.chunk(2)
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = g, u
        sd[p + "mlp.down_proj.weight"] = layer.down.weight.data
    return {k: v.contiguous() for k, v in sd.items()}


def save_hf(model: LlamaModel, folder: Path) -> None:
    """Write config.json + model.safetensors in Hugging Face layout."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))
    tmp = folder / "model.safetensors.tmp"
    save_file(hf_state_dict(model), str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")


def load_hf_folder(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    max_positions: int | None = None,
) -> LlamaModel:
    """Build a `LlamaModel` from a Hugging Face folder."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise WeightsNotFound(f"{folder} has no config.json; pass a Hugging Face model folder or a .gguf file")
    cfg = ModelConfig.from_file(folder / "config.json")
    tensors = read_safetensors(folder)
    model = LlamaModel(cfg, dtype=dtype, device=device, max_positions=max_positions)

    from tristream.engine.quantize import fp8_checkpoint, fp8_dequantize_tensor, install_fp8_checkpoint

    fp8 = fp8_checkpoint(tensors)

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise WeightsNotFound(f"tensor {name!r} missing from the checkpoint in {folder}")
        return fp8_dequantize_tensor(name, tensors) if fp8 else tensors[name]

    assign_hf_weights(model, get)
    if fp8:
        install_fp8_checkpoint(model, tensors)
    return model


def resolve_folder(path: str | Path, cache_dir: Path | None = None) -> Path:
    """The Hugging Face folder for a folder or .gguf path (converting the GGUF on first use)."""
    p = Path(path)
    if p.suffix == ".gguf":
        from tristream.engine.gguf_loader import cached_gguf_folder

        p = cached_gguf_folder(p, cache_dir=cache_dir)
    if not p.exists():
        raise WeightsNotFound(f"{path} does not exist")
    return p


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    max_positions: int | None = None, cache_dir: Path | None = None,
) -> LlamaModel:
    """Load a model from a Hugging Face folder or a GGUF file (dequantised and cached)."""
    return load_hf_folder(resolve_folder(path, cache_dir), dtype=dtype, device=device, max_positions=max_positions)
