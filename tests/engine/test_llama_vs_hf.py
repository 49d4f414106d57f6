"""Our Llama/Qwen2 module against transformers on the same tiny random weights (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine._tiny import tiny_hf_model
from tristream.engine.attention import AttnMetadata, TorchAttention
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.loader import load_model
from tristream.engine.sequence import SamplingParams


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def dense_logits(model, ids: list[int]) -> torch.Tensor:
    meta = AttnMetadata.dense(len(ids))
    with torch.inference_mode():
        h = model(model.embed(torch.tensor(ids)), TorchAttention(model.cfg, model.cos_sin, meta, None, model.dtype))
        return model.logits(h)


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2"])
def test_logits_match_transformers(kind: str, tmp_path: Path) -> None:
    hf = tiny_hf_model(kind, tmp_path)
    ours = load_model(tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (1, 200), generator=g)  # past 64 positions: llama3 scaling matters
    with torch.inference_mode():
        ref = hf(ids).logits[0].float()
    got = dense_logits(ours, ids[0].tolist())
    assert ref.abs().max() > 0.1
    assert rel_err(got, ref) <= 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_continuation_matches_transformers(kind: str, tmp_path: Path) -> None:
    hf = tiny_hf_model(kind, tmp_path, seed=3)
    prompt = [5, 17, 42, 99, 7, 250, 31, 8, 64, 12]
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    ref = out[0, len(prompt):].tolist()
    eng = LLMEngine(load_model(tmp_path), None, EngineConfig(block_size=4, num_blocks=64))
    got = eng.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert got == ref
