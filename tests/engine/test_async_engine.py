"""Async streams of deltas, cancel (barge-in) and incremental prefill through AsyncLLM."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from tests.engine._tiny import tiny_hf_model
from tristream.engine.async_engine import AsyncLLM
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.loader import load_model
from tristream.engine.sequence import FinishReason, SamplingParams


def test_stream_cancel_and_context(tmp_path: Path) -> None:
    tiny_hf_model("llama", tmp_path)
    model = load_model(tmp_path)
    eng = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64))
    ref = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64)).generate(
        [[5, 6, 7, 8, 9]], SamplingParams(max_tokens=8, ignore_eos=True))[0]

    async def main() -> None:
        llm = AsyncLLM(eng)
        try:
            s = llm.submit([5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True), priority=1,
                           deadline=1.0)
            toks = [d.token_id async for d in s]
            assert toks == ref
            long = llm.submit([1, 2, 3], SamplingParams(max_tokens=10_000, ignore_eos=True))
            n = 0
            async for d in long:
                n += 1
                if n == 3:
                    long.cancel()
                if d.finished:
                    assert d.finish_reason is FinishReason.CANCELLED
            assert n < 10
            ctx = llm.open_context([5, 6])
            ctx.append(token_ids=[7])
            with torch.inference_mode():
                ctx.append(embeddings=model.embed(torch.tensor([8, 9])))
            out = [d.token_id async for d in ctx.generate(SamplingParams(max_tokens=8, ignore_eos=True))]
            assert out == ref
        finally:
            llm.shutdown()
        assert eng.blocks.num_free == eng.blocks.num_blocks

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_per_request_kv_budget_evicts_and_matches_the_sync_engine(tmp_path: Path) -> None:
    """`submit(kv_budget_tokens=)` reaches the engine: the request evicts under its budget (a
    request without one does not) and streams the tokens the blocking engine gives with the same
    budget; a budget too small for the protected blocks is refused at submit."""
    from tristream.engine.kv_retention import KVBudgetError, RetentionConfig

    tiny_hf_model("llama", tmp_path)
    model = load_model(tmp_path)
    cfg = EngineConfig(block_size=4, num_blocks=64, retention=RetentionConfig(sink_tokens=4, text_window_tokens=8))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    sync = LLMEngine(model, None, cfg)
    sid = sync.add_request(list(range(3, 23)), params, kv_budget_tokens=24)
    ref: list[int] = []
    done = False
    while not done:
        for o in sync.step():
            if o.seq_id == sid:
                ref += [o.token_id] if o.token_id is not None else []
                done = o.finished
    assert len(ref) == 30 and sync.stats.retention.evictions > 0
    eng = LLMEngine(model, None, cfg)

    async def main() -> None:
        llm = AsyncLLM(eng)
        try:
            free = [d.token_id async for d in llm.submit(list(range(3, 23)), params)]
            assert len(free) == 30 and eng.stats.retention.evictions == 0
            got = [d.token_id async for d in llm.submit(list(range(3, 23)), params, kv_budget_tokens=24)]
            assert got == ref and eng.stats.retention.evictions > 0
            try:
                llm.submit([1, 2, 3], params, kv_budget_tokens=8)
            except KVBudgetError as e:
                assert "too small" in str(e)
            else:
                raise AssertionError("a budget below sinks + window was accepted")
        finally:
            llm.shutdown()
        assert eng.blocks.num_free == eng.blocks.num_blocks

    asyncio.run(asyncio.wait_for(main(), timeout=60))
