"""Paged KV vs contiguous attention, prefix caching, chunked/incremental prefill, preemption, cancel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine._tiny import tiny_hf_model
from tristream.engine.attention import AttnMetadata, TorchAttention
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.loader import load_model
from tristream.engine.models.llama import LlamaModel
from tristream.engine.runner import PrefillChunk
from tristream.engine.sequence import FinishReason, SamplingParams, SeqStatus, Sequence

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    d: Path = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama3", d, seed=7)
    return load_model(d)


def dense_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    meta = AttnMetadata.dense(len(ids))
    with torch.inference_mode():
        h = model(model.embed(torch.tensor(ids)), TorchAttention(model.cfg, model.cos_sin, meta, None, model.dtype))
        return model.logits(h)


def engine(model: LlamaModel, **kw) -> LLMEngine:
    cfg = dict(block_size=4, num_blocks=64, max_prefill_tokens=512)
    cfg.update(kw)
    return LLMEngine(model, None, EngineConfig(**cfg))


PROMPTS = [[5, 17, 42, 99, 7, 250, 31, 8, 64, 12, 13, 14, 15], [100, 101, 102], list(range(20, 60))]


def test_paged_prefill_chunks_equal_contiguous(model: LlamaModel) -> None:
    eng = engine(model)
    ids = list(range(3, 40))
    seq = Sequence(keys=ids)
    # scattered, non-monotonic block ids
    seq.block_table = [eng.blocks.allocate() for _ in range(10)][::-1]
    ref = dense_logits(model, ids)
    start = 0
    for n in (5, 7, 1, 1, 9, 14):
        got = eng.runner.prefill([PrefillChunk(seq, start, n, True)])
        assert got is not None
        start += n
        err = float((got[0] - ref[start - 1]).abs().max() / ref[start - 1].abs().max())
        assert err < 1e-5


def test_engine_greedy_equals_contiguous_loop(model: LlamaModel) -> None:
    ref = []
    for p in PROMPTS:
        ids = list(p)
        for _ in range(GREEDY.max_tokens):
            ids.append(int(dense_logits(model, ids)[-1].argmax()))
        ref.append(ids[len(p):])
    assert engine(model).generate(PROMPTS, GREEDY) == ref  # batched, paged
    assert engine(model, max_prefill_tokens=5).generate(PROMPTS, GREEDY) == ref  # chunked prefill


def test_prefix_cache_hit_is_identical(model: LlamaModel) -> None:
    base = engine(model, enable_prefix_cache=False).generate([PROMPTS[2]], GREEDY)[0]
    eng = engine(model)
    first = eng.generate([PROMPTS[2]], GREEDY)[0]
    assert eng.stats.prefix_cached_tokens == 0
    second = eng.generate([PROMPTS[2]], GREEDY)[0]
    assert eng.stats.prefix_cached_tokens >= 36  # 9 of the 10 full blocks (the last token is recomputed)
    assert first == second == base
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_incremental_prefill_with_embeddings_equals_prompt(model: LlamaModel) -> None:
    prompt = PROMPTS[2]
    ref = engine(model).generate([prompt], GREEDY)[0]
    eng = engine(model, max_prefill_tokens=6)
    sid = eng.add_request(prompt[:10], generate=False)
    eng.step()
    with torch.inference_mode():
        emb = model.embed(torch.tensor(prompt[10:25]))  # "vision tokens": precomputed embeddings
    eng.append(sid, embeddings=emb)
    eng.append(sid, token_ids=prompt[25:])
    for _ in range(10):  # the context is prefilled while the "user is still speaking"
        eng.step()
    seq = eng.seqs[sid]
    assert seq.num_pending == 0 and seq.num_computed == len(prompt)
    eng.start_generation(sid, GREEDY)
    out: list[int] = []
    while True:
        res = [o for o in eng.step() if o.seq_id == sid]
        out += [o.token_id for o in res if o.token_id is not None]
        if any(o.finished for o in res):
            break
    assert out == ref


def test_preemption_by_recompute_keeps_outputs(model: LlamaModel) -> None:
    ref = engine(model).generate(PROMPTS, GREEDY)
    eng = engine(model, num_blocks=16, enable_prefix_cache=False)  # too few blocks for all three
    ids = [eng.add_request(p, GREEDY, priority=i) for i, p in enumerate(PROMPTS)]
    out: dict[int, list[int]] = {i: [] for i in ids}
    done: set[int] = set()
    for _ in range(500):
        for o in eng.step():
            if o.token_id is not None:
                out[o.seq_id].append(o.token_id)
            if o.finished:
                done.add(o.seq_id)
        if len(done) == 3:
            break
    assert eng.stats.preemptions > 0
    assert [out[i] for i in ids] == ref
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_cancel_frees_blocks_within_one_step(model: LlamaModel) -> None:
    eng = engine(model)
    sid = eng.add_request(PROMPTS[2], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.blocks.num_free < eng.blocks.num_blocks
    eng.cancel(sid)
    outs = eng.step()
    assert any(o.seq_id == sid and o.finished and o.finish_reason is FinishReason.CANCELLED for o in outs)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert sid not in eng.seqs and eng.stats.cancelled == 1


def test_priority_orders_prefill(model: LlamaModel) -> None:
    eng = engine(model, max_prefill_tokens=40)
    low = eng.add_request(PROMPTS[2], GREEDY, priority=0)
    high = eng.add_request(PROMPTS[2][:30], GREEDY, priority=5)
    first = eng.step()
    assert [o.seq_id for o in first] == [high]  # the high-priority prompt took the budget first
    assert eng.seqs[low].status in (SeqStatus.RUNNING, SeqStatus.WAITING)


def test_step_restricted_by_an_external_scheduler(model: LlamaModel) -> None:
    eng = engine(model)
    a = eng.add_request(PROMPTS[0], GREEDY)
    b = eng.add_request(PROMPTS[1], GREEDY)
    for _ in range(3):
        assert {o.seq_id for o in eng.step(allow={a})} == {a}
    assert eng.seqs[b].num_computed == 0
    outs = eng.step(max_prefill_tokens=2)  # b's prefill is chunked by the per-step budget
    assert eng.seqs[b].num_computed == 2 and {o.seq_id for o in outs} == {a}


def test_commands_for_finished_sequences_are_counted_not_lost_silently(model: LlamaModel) -> None:
    eng = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, use_graphs=False))
    sid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=1))
    while eng.has_work():
        eng.step()
    assert sid not in eng.seqs  # finished and forgotten
    eng.append(sid, token_ids=[8, 9])
    eng.start_generation(sid)
    eng.cancel(sid)
    eng.step()
    assert eng.stats.ignored == {"append": 1, "start_generation": 1, "cancel": 1}
