"""A tiny GGUF written with gguf's GGUFWriter loads (config, q/k un-permutation, dequantisation, cache)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine._tiny import tiny_hf_model
from tristream.engine.loader import load_model

gguf = pytest.importorskip("gguf")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf: torch.nn.Module, path: Path, quant_ffn: bool) -> None:
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}

    def put(name: str, arr: np.ndarray, quant: bool = False) -> None:
        if quant:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"])
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], nh))
        put(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], nkv))
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"], quant_ffn)
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"], quant_ffn)
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"], quant_ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("quant_ffn,tol", [(False, 1e-4), (True, 3e-2)])
def test_tiny_gguf_loads_and_matches(tmp_path: Path, quant_ffn: bool, tol: float) -> None:
    hf = tiny_hf_model("llama", tmp_path / "hf", seed=5)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, path, quant_ffn)
    cache = tmp_path / "cache"
    model = load_model(path, cache_dir=cache)
    assert model.cfg.num_kv_heads == 2 and not model.cfg.tie_word_embeddings
    ids = torch.randint(3, 300, (1, 50), generator=torch.Generator().manual_seed(0))
    from tests.engine.test_llama_vs_hf import dense_logits, rel_err

    with torch.inference_mode():
        ref = hf(ids).logits[0]
    assert rel_err(dense_logits(model, ids[0].tolist()), ref) <= tol
    folders = list(cache.iterdir())
    assert len(folders) == 1 and (folders[0] / "model.safetensors").exists()
    again = load_model(path, cache_dir=cache)  # second load comes from the safetensors cache
    assert torch.equal(again.layers[0].qkv.weight, model.layers[0].qkv.weight)
