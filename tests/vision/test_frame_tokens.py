"""Vision tokens through the scheduled engine on a CPU, tiny shapes: `FrameTokenizer` (random tower and
projector) → `SessionVision` (frames aligned to the speech) → `ScheduledChat.prefill` while the user
speaks → the answer's turn continues that context. The GPU twin with SmolLM2 and SigLIP-B/16 is
`tests/serve/test_vision_tokens_gpu.py`."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest

torch = pytest.importorskip("torch")
T = TypeVar("T")


class FrameSession:
    """What `SessionVision` reads of a pipeline session: observers, the frame ring, the clock."""

    def __init__(self, capacity: int = 16) -> None:
        from tristream.core.ring import ObjectRing
        from tristream.sched.clock import MonotonicClock

        self.clock = MonotonicClock()
        self.frames: ObjectRing[np.ndarray] = ObjectRing(capacity, name="test.frames")
        self.observers: list[Any] = []

    def subscribe(self, fn: Any) -> Any:
        self.observers.append(fn)
        return lambda: None

    def publish(self, ev: Any) -> None:
        for fn in self.observers:
            fn(ev)


def run_vision_turn(turn: Coroutine[Any, Any, T], se: Any, vt: Any) -> tuple[T, dict[str, Any]]:
    """`turn` run (120 s at most), then the scheduled engine's counters; `se` and the vision pool of
    `vt` are shut down either way."""
    try:
        out = asyncio.run(asyncio.wait_for(turn, 120))
        return out, se.stats()["counters"]
    finally:
        se.shutdown()
        vt.pool.shutdown()


def test_frame_tokens_enter_the_context_while_the_user_speaks() -> None:
    from tristream.observe.events import SpeechStarted
    from tristream.sched.real import build_engine
    from tristream.sched.scheduled_engine import ScheduledEngine
    from tristream.serve.sched_backend import CPU_TARGET_FACTOR, ScheduledChat, scaled_config
    from tristream.serve.vision_tokens import VisionPolicy, VisionTokens
    from tristream.vision.frames import FrameTokenizer
    from tristream.vision.vit import VisionTowerConfig

    eng = build_engine("tiny-random", "cpu", 16 << 20)
    cfg = VisionTowerConfig(kind="siglip", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                            image_size=32, patch_size=8)
    tok = FrameTokenizer.random(eng.model.cfg.hidden_size, "cpu", torch.float32, keep_ratio=0.5, cfg=cfg,
                                match_rms=0.02)
    assert tok.tokens_per_frame == 8
    vt = VisionTokens(tok, VisionPolicy(max_images=2, min_gap_ms=0.0, wait_ms=5000.0))
    se = ScheduledEngine(eng, scaled_config(CPU_TARGET_FACTOR))
    sess = FrameSession()
    sv = vt.session()
    sv.bind(sess)
    chat = ScheduledChat(se, lambda: "silver", max_tokens=4, vision=sv)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(3)]
    text = "what do you see in front of you"

    async def go() -> list[str]:
        t0 = sess.clock.now_ns()
        sess.frames.append(t0 - 5_000_000, frames[0])  # before the speech: not aligned
        sess.publish(SpeechStarted(0, t0))
        for i, f in enumerate(frames[1:]):
            sess.frames.append(t0 + (i + 1) * 1_000_000, f)
        words = text.split()
        for i in range(1, len(words) + 1):
            chat.prefill("s", [{"role": "system", "content": "be brief"}, {"role": "user", "content": " ".join(words[:i])}])
            await asyncio.sleep(0.05)
        return [d async for d in chat.stream([{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": text}], 4)]

    out, st = run_vision_turn(go(), se, vt)
    assert out  # the answer comes (token text of a model without tokenizer)
    assert vt.counters["frames_aligned"] == 2 and vt.counters["images_to_turns"] == 2
    assert st["embedding_positions"] == 2 * 8  # each frame's tokens went to the engine once
    assert st["contexts_reused"] == 1 and st["prefills"] >= 1
