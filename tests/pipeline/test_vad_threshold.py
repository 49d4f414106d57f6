"""A client's ``turn_detection.threshold`` reaches the running session's VAD: speech whose
probabilities stay below the threshold starts no turn, the same speech under it does."""

from __future__ import annotations

import asyncio

import numpy as np

from tristream.observe.events import SpeechStarted
from tristream.pipeline.session import Session, SessionConfig
from tristream.sched.clock import VirtualClock

CHUNK = 320
CHUNK_NS = 20_000_000


def test_the_threshold_applies_to_the_running_vad(models, say) -> None:
    # a far-away talker in a noisy room: speech at 1/10 of its level under white noise, loud
    # enough that silero's probabilities peak between 0.6 and 0.97 instead of at 1.0
    speech = np.concatenate([np.zeros(8000, np.float32), 0.1 * say("What is the capital of France?"),
                             np.zeros(16000, np.float32)])
    noise = np.random.default_rng(0).standard_normal(speech.shape[0]).astype(np.float32)
    for level in (0.03, 0.04, 0.05, 0.06):
        pcm = speech + level * noise
        probe = models.vad.stream("probe")
        probe.keep_probabilities = True
        for i in range(0, pcm.shape[0], CHUNK):
            probe.push(pcm[i:i + CHUNK], i * 62_500)
        top = max(probe.probabilities)
        if top < 0.97:
            break
    assert 0.6 < top < 0.97, top

    async def starts(threshold: float) -> int:
        clock = VirtualClock(start_ns=1_000_000_000)
        session = Session(models, clock=clock, config=SessionConfig(speak=False, max_tokens=4))
        seen: list[SpeechStarted] = []
        session.subscribe(lambda ev: seen.append(ev) if isinstance(ev, SpeechStarted) else None)
        session.start()
        session.set_turn_detection(500.0, None, threshold)  # what a session.update does
        assert session.vad.options.threshold == min(max(threshold, 0.01), 0.99)
        for i in range(0, pcm.shape[0], CHUNK):
            session.push_audio(pcm[i:i + CHUNK], clock.now_ns())
            await session.settle_input()
            clock.advance(CHUNK_NS)
        await session.close()
        return len(seen)

    assert asyncio.run(starts(0.5)) == 1
    assert asyncio.run(starts(top + 0.01)) == 0
    assert asyncio.run(starts(0.0)) == 1  # 0 acts as 0.01
