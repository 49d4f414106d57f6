"""Vision tokens in a GPU assistant session: camera frames aligned to the user's speech → our SigLIP
tower (random weights: no VLM weights exist offline) → tokens prefilled into the session's context on
the scheduled engine while the user speaks → the answer of the real SmolLM2-135M still comes.

`test_vision_tokens_reach_the_context_and_the_answer_comes` drives one session's `ScheduledChat` as
the pipeline does (partial prompts while the user speaks, then the answer's prompt) with a real
frame ring; `test_default_server.py` checks the same path through ``tristream serve`` on CUDA.
The CPU twin (tiny shapes) is `tests/vision/test_frame_tokens.py`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


from tests.vision.test_frame_tokens import FrameSession, run_vision_turn  # noqa: E402  (after the CUDA skip)


def frame(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def engine() -> Any:
    pytest.importorskip("gguf")
    from tristream.engine.cli_support import ModelNotFound
    from tristream.sched.real import build_engine

    try:
        return build_engine("smollm2", "cuda", 2 << 30)
    except ModelNotFound as exc:
        pytest.skip(str(exc))


def test_vision_tokens_reach_the_context_and_the_answer_comes(engine: Any) -> None:
    from tristream.observe.events import SpeechStarted
    from tristream.pipeline.prompt import DECODE, SYSTEM_PROMPT
    from tristream.sched.scheduled_engine import ScheduledEngine
    from tristream.serve.sched_backend import ScheduledChat, scaled_config
    from tristream.serve.vision_tokens import build_vision_tokens

    se = ScheduledEngine(engine, scaled_config(1.0), temperature=DECODE.temperature,
                         repetition_penalty=DECODE.repetition_penalty)
    vt = build_vision_tokens(engine, "cuda")
    assert vt.tokenizer.weights == "random" and vt.tokenizer.tokens_per_frame == 49
    sess = FrameSession(64)
    sv = vt.session()
    sv.bind(sess)
    chat = ScheduledChat(se, lambda: "silver", max_tokens=24, vision=sv)
    words = "What is the capital of France".split()

    async def go() -> str:
        t0 = sess.clock.now_ns()
        sess.publish(SpeechStarted(0, t0))
        sess.frames.append(t0 + 1_000_000, frame(0))
        for i in range(1, len(words) + 1):  # partials as the streaming ASR commits words
            if i == 4:
                sess.frames.append(sess.clock.now_ns(), frame(1))
            chat.prefill("s0", [{"role": "system", "content": SYSTEM_PROMPT},
                                {"role": "user", "content": " ".join(words[:i])}])
            await asyncio.sleep(0.4)  # frame 1 comes > 1 s (VisionPolicy.min_gap_ms) after frame 0
        parts = []
        t_end = time.perf_counter()
        first = None
        async for d in chat.stream([{"role": "system", "content": SYSTEM_PROMPT},
                                    {"role": "user", "content": " ".join(words) + "?"}], 24):
            first = first or time.perf_counter()
            parts.append(d)
        assert first is not None
        print(f"end of turn -> first token {1e3 * (first - t_end):.1f} ms")
        return "".join(parts)

    answer, st = run_vision_turn(go(), se, vt)
    print("answer:", answer, "| counters:", st, vt.counters)
    assert answer.strip()
    assert vt.counters.get("frames_aligned", 0) == 2 and vt.counters.get("images_to_turns") == 2
    assert st["embedding_positions"] >= 2 * 49  # both frames' tokens were handed to the engine
    assert st["prefills"] == len(words) and st["contexts_reused"] == 1  # the answer continued the context
    assert vt.tokenizer.stats.frames >= 3  # the warm-up frame and the two aligned ones
