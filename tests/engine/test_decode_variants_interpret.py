"""Decode kernel variants agree on a real (tiny, HF-saved) model: the batch-1 fused
norm+QKV+RoPE+store layer and its tiles against the cuBLAS-style variant, greedy tokens
included. GPU, or CPU under TRITON_INTERPRET=1 (PDL itself needs Hopper: see
test_gpu_graphs.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.engine._tiny import tiny_hf_model
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.loader import load_model
from tristream.engine.models.llama import LlamaModel
from tristream.engine.sequence import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    d: Path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    tiny_hf_model(request.param, d, seed=5)
    return load_model(d, device="cuda" if torch.cuda.is_available() else "cpu")


def _engine(model: LlamaModel, kernels: str) -> LLMEngine:
    return LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=128, max_model_len=256, graph_buckets=(1, 2),
                                               triton_decode=True, decode_kernels=kernels, use_graphs=False))


def test_b1_variant_logits_and_tokens_equal_the_other_variants(model: LlamaModel) -> None:
    prompt = list(range(3, 30))
    out: dict[str, list[int]] = {}
    logits: dict[str, torch.Tensor] = {}
    for kernels in ("cublas", "b1", "b1_hc", "bw", "b1w", "b8w", "b4w_ln"):
        eng = _engine(model, kernels)
        dec = eng.runner.decoder
        assert dec is not None and dec.variant_for(1) == kernels
        out[kernels] = eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        logits[kernels] = dec.forward(1).float()  # the last step's inputs are still in the buffers
    assert all(tokens == out["cublas"] for tokens in out.values()), out
    ref = logits["cublas"]
    for k in out:
        assert float((logits[k] - ref).norm() / ref.norm()) < 1e-5, k


def test_proj_tile_widens_only_k_between_1024_and_the_cap() -> None:
    pytest.importorskip("triton")
    from tristream.engine.kernels.decode_fused import TILES, proj_tile

    wide = TILES["b8w"][0]
    assert proj_tile(wide, 576) is None  # one default tile already holds it
    assert proj_tile(wide, 1024) is None
    assert proj_tile(wide, 1536) == (8, 2048)  # SmolLM2-135M's down projection: one tile
    assert proj_tile(wide, 2048) == (8, 2048)
    assert proj_tile(wide, 8192) == (8, 2048)  # capped: the loop takes the rest
    assert proj_tile(None, 1536) is None and proj_tile((8, 2048), 2048) == (8, 2048)  # other tiles as given,
    assert proj_tile((8, 2048), 576) == (8, 1024)  # no wider than K needs
    assert proj_tile((16, 256), 576) == (16, 256)


def test_unknown_variant_is_refused(model: LlamaModel) -> None:
    with pytest.raises(ValueError, match="b1_pdl"):
        _engine(model, "b2")


@pytest.mark.parametrize("kernels", ["cublas", "b1"])
def test_triton_decode_after_eviction_equals_the_torch_path(model: LlamaModel, kernels: str) -> None:
    """KV retention on the Triton decode path (`DecodeGraphs.prepare` in cache space, RoPE at the
    logical position): a sequence that outgrows its budget decodes the same greedy tokens as the
    torch reference path with the same evictions."""
    from tristream.engine.kv_retention import RetentionConfig

    out: dict[bool, list[int]] = {}
    for triton in (True, False):
        eng = LLMEngine(model, None, EngineConfig(
            block_size=4, num_blocks=128, max_model_len=256, graph_buckets=(1, 2), triton_decode=triton,
            decode_kernels=kernels, use_graphs=False, kv_budget_tokens=24,
            retention=RetentionConfig(sink_tokens=4, text_window_tokens=8)))
        out[triton] = eng.generate([list(range(3, 23))], SamplingParams(max_tokens=30, ignore_eos=True))[0]
        assert eng.stats.retention.evictions > 0 and sum(eng.stats.retention.evicted_blocks.values()) >= 5
    assert out[True] == out[False]
