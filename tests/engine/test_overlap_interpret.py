"""Overlapped decode on the Triton decode path (`DecodeGraphs` buffers, `ChainedDecode` writing
the next step's ids on the device): the same outputs as the synchronous engine, with padded
buckets and after KV eviction. GPU, or CPU under TRITON_INTERPRET=1 (no CUDA graphs there: the
buckets run eagerly from the same persistent buffers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.engine._tiny import tiny_hf_model
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.kv_retention import RetentionConfig
from tristream.engine.loader import load_model
from tristream.engine.models.llama import LlamaModel
from tristream.engine.sequence import FinishReason, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    d: Path = tmp_path_factory.mktemp("tiny_overlap_triton")
    tiny_hf_model("qwen2", d, seed=4)
    return load_model(d, device="cuda" if torch.cuda.is_available() else "cpu")


def _run(model: LlamaModel, overlap: bool, prompts: list[list[int]], params: list[SamplingParams],
         cancel_after: int | None = None, logits_path: bool = False, **kw: object
         ) -> tuple[list[list[tuple[int | None, FinishReason | None]]], LLMEngine]:
    """logits_path: synchronous greedy steps through float32 logits and a copy back, not the
    graphs' own argmax read from host memory (`DecodeGraphs.run_greedy_host`)."""
    cfg: dict[str, object] = dict(block_size=4, num_blocks=128, max_model_len=256, graph_buckets=(1, 2, 4),
                                  triton_decode=True, decode_kernels="cublas", overlap=overlap)
    cfg.update(kw)
    eng = LLMEngine(model, None, EngineConfig(**cfg))  # type: ignore[arg-type]
    if logits_path:
        eng.runner.decode_greedy_host = lambda seqs: None  # type: ignore[method-assign]
    assert eng.runner.decoder is not None
    eng.runner.decoder.capture()  # decode graphs on CUDA; nothing on CPU (buckets run eagerly)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    out: dict[int, list[tuple[int | None, FinishReason | None]]] = {i: [] for i in ids}
    for _ in range(300):
        if cancel_after is not None and len(out[ids[0]]) == cancel_after:
            eng.cancel(ids[0])
            cancel_after = None
        for o in eng.step():
            out[o.seq_id].append((o.token_id, o.finish_reason))
        if not eng.has_work():
            break
    assert eng.blocks.num_free == eng.blocks.num_blocks
    return [out[i] for i in ids], eng


def test_padded_bucket_with_finishes_and_cancel(model: LlamaModel) -> None:
    prompts = [list(range(3, 14)), [40, 41, 42], list(range(60, 79))]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 5, 9)]
    ref, _ = _run(model, False, prompts, params, cancel_after=7)
    got, eng = _run(model, True, prompts, params, cancel_after=7)
    assert got == ref
    assert ref[0][-1] == (None, FinishReason.CANCELLED) and [len(r) for r in ref[1:]] == [5, 9]
    assert eng.stats.overlap_steps >= 4 and eng.stats.overlap_discarded >= 1


def test_overlap_after_kv_eviction(model: LlamaModel) -> None:
    params = [SamplingParams(max_tokens=26, ignore_eos=True)]
    kw = dict(kv_budget_tokens=24, retention=RetentionConfig(sink_tokens=4, text_window_tokens=8))
    ref, _ = _run(model, False, [list(range(3, 23))], params, logits_path=True, **kw)
    sync, _ = _run(model, False, [list(range(3, 23))], params, **kw)
    got, eng = _run(model, True, [list(range(3, 23))], params, **kw)
    assert sync == ref and got == ref and len(got[0]) == 26
    assert eng.stats.retention.evictions > 0 and eng.stats.overlap_steps > 0
