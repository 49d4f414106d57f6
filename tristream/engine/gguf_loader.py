"""GGUF checkpoints: config from metadata, weights dequantised via the `gguf` package, cached.

The first load parses the GGUF file (a few seconds for SmolLM2-135M), dequantises every
tensor to float32, undoes llama.cpp's rotary permutation of q/k for the `llama`
architecture, and writes a Hugging Face folder (config.json, model.safetensors and the
tokenizer files with the chat template) into the user cache dir. Later loads read that
folder through the memory-mapped safetensors path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

from tristream.engine.config import ModelConfig, UnsupportedModel
from tristream.engine.disk_cache import cache_root, content_key, prune, touch

__all__ = ["cache_root", "cached_gguf_folder", "config_from_gguf", "convert_gguf"]


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def config_from_gguf(reader: Any) -> ModelConfig:
    """ModelConfig from a GGUFReader's metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported (llama, qwen2 are)")
    k = arch + "."
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(_field(reader, k + "vocab_size", 0) or int(emb.shape[-1]))
    names = {t.name for t in reader.tensors}
    nh = int(_field(reader, k + "attention.head_count"))
    hidden = int(_field(reader, k + "embedding_length"))
    head_dim = int(_field(reader, k + "rope.dimension_count", hidden // nh) or hidden // nh)
    scaling = None
    stype = _field(reader, k + "rope.scaling.type")
    if stype == "linear":
        scaling = {"rope_type": "linear", "factor": float(_field(reader, k + "rope.scaling.factor"))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, k + "feed_forward_length")),
        num_layers=int(_field(reader, k + "block_count")),
        num_heads=nh,
        num_kv_heads=int(_field(reader, k + "attention.head_count_kv", nh)),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, k + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, k + "rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position=int(_field(reader, k + "context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        arch=arch,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope → half-split rope)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face tensor name for a GGUF tensor name (None if unused)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        m = _LAYER_MAP.get(rest)
        return None if m is None else f"model.layers.{idx}.{m}"
    return None


def read_gguf_tensors(reader: Any, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to float32 under Hugging Face names."""
    from gguf import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        w = w.reshape(shape)
        if cfg.arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            w = _unpermute(w, cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    return out


def _cache_key(path: Path) -> str:
    """Keyed by the file's contents: a reinstalled or copied GGUF reuses its entry."""
    return f"{path.stem}-{content_key([path], 'gguf-v2', length=16)}"


def _save_tokenizer(path: Path, reader: Any, folder: Path) -> None:
    import gguf
    from transformers import AutoTokenizer

    # transformers parses the whole file again to build the tokenizer (2.4 s of a 7 s first load
    # for SmolLM2-135M): while it does, hand it the reader already built for this path
    original = gguf.GGUFReader

    def reuse(p: Any, *a: Any, **k: Any) -> Any:
        return reader if Path(p).resolve() == path.resolve() and not a and not k else original(p, *a, **k)

    with mock.patch.object(gguf, "GGUFReader", reuse):
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(folder))


def convert_gguf(path: Path, folder: Path) -> None:
    """Dequantise a GGUF file into a Hugging Face folder (config, safetensors, tokenizer)."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(str(path))
    cfg = config_from_gguf(reader)
    tensors = read_gguf_tensors(reader, cfg)
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": str(path)})
    try:
        if "tokenizer.ggml.model" not in reader.fields:
            raise ValueError("the GGUF file carries no tokenizer")
        _save_tokenizer(path, reader, tmp)
    except Exception as exc:  # a model without a usable tokenizer still loads for benchmarks
        (tmp / "tokenizer_error.txt").write_text(f"{type(exc).__name__}: {exc}\n")
    try:
        tmp.replace(folder)
    except OSError:  # another process finished the same conversion first: keep theirs
        if not (folder / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def cached_gguf_folder(path: str | Path, cache_dir: Path | None = None) -> Path:
    """The Hugging Face folder holding `path`'s dequantised weights, converting on first use."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    root = cache_dir or cache_root() / "gguf"
    folder = root / _cache_key(path)
    if not (folder / "model.safetensors").exists():
        if folder.exists():  # an incomplete entry (killed mid-write): convert again
            shutil.rmtree(folder)
        convert_gguf(path, folder)
        prune(root, keep=folder)
    touch(folder)
    return folder
