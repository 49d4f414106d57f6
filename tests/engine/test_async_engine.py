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
