"""GPU: KV retention through the CUDA paths (paged Triton prefill, small-prefill graphs, decode
graphs): after eviction, every logits row equals the masked dense reference computed on the
same device (positions evicted when the row was computed are masked; RoPE positions logical).

Run on the device: `.venv/bin/python -m pytest tests/engine/test_retention_engine_gpu.py -q`
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine._tiny import random_llama_cuda
from tests.engine.test_retention_engine import Recorder, evicted_positions
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.kv_retention import RetentionConfig
from tristream.engine.models.llama import LlamaModel
from tristream.engine.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.gpu

BS = 16
RET = RetentionConfig(sink_tokens=4, text_window_tokens=32)  # min budget (1 + 2 + 2) blocks = 80 tokens
TOL = {torch.float32: 1e-2, torch.bfloat16: 8e-2}  # norm-relative; Triton fp32 dots may use TF32


def engine(model: LlamaModel, **kw: Any) -> LLMEngine:
    cfg: dict[str, Any] = dict(block_size=BS, num_blocks=256, max_model_len=1024, max_prefill_tokens=40,
                               retention=RET, use_graphs=True, overlap=False)  # rows recorded per synchronous step
    cfg.update(kw)
    eng = LLMEngine(model, None, EngineConfig(**cfg))
    eng.runner.capture()
    return eng


def check_rows(rec: Recorder, model: LlamaModel, seq: Sequence, dtype: torch.dtype) -> int:
    return rec.check(model, seq, TOL[dtype], norm=True)


def run_all(eng: LLMEngine, seq: Sequence, budget_blocks: int) -> None:
    for _ in range(5000):
        if not eng.has_work():
            return
        eng.step()
        if seq.block_table:
            assert len(seq.block_table) <= budget_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_context_paged_prefill_and_decode_graphs_after_eviction(dtype: torch.dtype) -> None:
    """Embeddings force the eager paged prefill kernel; decoding replays the decode graphs."""
    model = random_llama_cuda(dtype)
    eng = engine(model)
    rec = Recorder(eng)
    g = torch.Generator().manual_seed(0)
    hid = model.cfg.hidden_size
    sid = eng.add_request(torch.randint(3, 5000, (16,), generator=g).tolist(), generate=False, kv_budget_tokens=96)
    eng.append(sid, embeddings=torch.randn(48, hid, generator=g) * 0.05)  # positions 16..63: 3 vision blocks
    eng.append(sid, token_ids=torch.randint(3, 5000, (32,), generator=g).tolist())
    eng.append(sid, embeddings=torch.randn(48, hid, generator=g) * 0.05)  # 96..143: 3 vision blocks
    eng.append(sid, token_ids=torch.randint(3, 5000, (25,), generator=g).tolist())
    eng.start_generation(sid, SamplingParams(max_tokens=70, ignore_eos=True))
    eng.step()
    seq = eng.seqs[sid]
    run_all(eng, seq, 6)
    st = eng.stats.retention
    assert st.evicted_blocks.get("vision_low_attention", 0) >= 4 and st.probes >= 1
    assert st.evicted_blocks.get("text_outside_window", 0) >= 1
    assert eng.runner.decoder is not None and eng.runner.decoder.graphs  # decode replayed graphs
    assert check_rows(rec, model, seq, dtype) >= 70
    assert eng.stats.preemptions == 0 and eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_text_context_prefill_graphs_after_eviction(dtype: torch.dtype) -> None:
    """Small text chunks replay the prefill graphs with compacted cache indexes."""
    model = random_llama_cuda(dtype)
    eng = engine(model, max_prefill_tokens=24)
    graphs = eng.runner.prefill_graphs
    assert graphs is not None
    rec = Recorder(eng)
    g = torch.Generator().manual_seed(1)
    sid = eng.add_request(torch.randint(3, 5000, (8,), generator=g).tolist(), generate=False, kv_budget_tokens=80)
    seq: Sequence | None = None
    for _ in range(12):  # incremental prefill: 12 appends of 17 tokens, well past the budget
        eng.append(sid, token_ids=torch.randint(3, 5000, (17,), generator=g).tolist())
        eng.step()
        seq = eng.seqs[sid]
        run_all(eng, seq, 5)
    assert seq is not None and seq.cache_offset > 0
    before = graphs.replays
    eng.append(sid, token_ids=torch.randint(3, 5000, (9,), generator=g).tolist())
    eng.start_generation(sid, SamplingParams(max_tokens=20, ignore_eos=True))
    run_all(eng, seq, 5)
    assert graphs.replays > before > 0
    assert eng.stats.retention.evicted_blocks.get("text_outside_window", 0) >= 8
    assert check_rows(rec, model, seq, dtype) >= 20
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_batched_decode_mixes_evicted_and_plain_sequences() -> None:
    """One decode graph batch: sequences with different cache offsets and one without a budget."""
    model = random_llama_cuda(torch.float32)
    eng = engine(model)
    rec = Recorder(eng)
    g = torch.Generator().manual_seed(2)
    ids = []
    for i, budget in enumerate([80, 96, None, 112]):
        prompt = torch.randint(3, 5000, (60 + 23 * i,), generator=g).tolist()
        ids.append(eng.add_request(prompt, SamplingParams(max_tokens=60, ignore_eos=True), kv_budget_tokens=budget))
    eng.step()
    seqs = [eng.seqs[i] for i in ids]
    while eng.has_work():
        eng.step()
    assert {s.cache_offset > 0 for s in seqs} == {True, False}
    for s in seqs:
        assert check_rows(rec, model, s, torch.float32) >= 60
    assert eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_preemption_after_eviction_recomputes_kept_positions_on_gpu(dtype: torch.dtype) -> None:
    """A preempted sequence recomputes only its kept blocks (gathered logical positions, vision
    embeddings included) through the CUDA prefill paths; generation afterwards is exact."""
    model = random_llama_cuda(dtype)
    eng = engine(model, num_blocks=16, max_prefill_tokens=64)
    rec = Recorder(eng)
    g = torch.Generator().manual_seed(4)
    low = eng.add_request(torch.randint(3, 5000, (16,), generator=g).tolist(), generate=False,
                          kv_budget_tokens=160)  # 10 blocks
    eng.append(low, embeddings=torch.randn(96, model.cfg.hidden_size, generator=g) * 0.05)  # blocks 1-6
    eng.append(low, token_ids=torch.randint(3, 5000, (48,), generator=g).tolist())
    eng.step()
    seq = eng.seqs[low]
    run_all(eng, seq, 10)
    eng.append(low, token_ids=torch.randint(3, 5000, (40,), generator=g).tolist())  # 3 blocks must go
    run_all(eng, seq, 10)
    assert len(seq.evicted_blocks) >= 3 and eng.stats.retention.probes >= 1
    mark = len(rec.rows)
    hi = eng.add_request(torch.randint(3, 5000, (120,), generator=g).tolist(),
                         SamplingParams(max_tokens=3, ignore_eos=True), priority=5)
    run_all(eng, seq, 10)
    assert hi not in eng.seqs and seq.num_preemptions >= 1
    redone = {p for s, p, _, _ in rec.rows[mark:] if s is seq}
    assert redone and not redone & evicted_positions(seq, BS)
    eng.start_generation(low, SamplingParams(max_tokens=8, ignore_eos=True))
    run_all(eng, seq, 10)
    assert check_rows(rec, model, seq, dtype) >= 8
    assert eng.blocks.num_free == eng.blocks.num_blocks
