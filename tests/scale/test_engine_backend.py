"""`EngineTextBackend` (the GPU replicas' backend for bench/scale.py) on CPU with a tiny random model,
driven through the same `RealtimeSession` the replicas run."""

from __future__ import annotations

import asyncio
import base64
import time

from tests.serve.helpers import run
from tristream.serve import protocol as P
from tristream.serve.session import RealtimeSession
from tristream.serve.unscheduled import engine_factory


def test_text_turns_on_the_shared_engine() -> None:
    factory = engine_factory("tiny-random", "cpu", kv_bytes=16 << 20, max_tokens=6)

    async def go() -> None:
        outs: list[list[dict]] = [[], []]
        sessions = [RealtimeSession(f"s{i}", factory(), outs[i].append, time.monotonic_ns) for i in range(2)]
        for s in sessions:
            await s.open()
        for turn in range(2):
            for i, s in enumerate(sessions):  # both sessions answer at once on the one engine
                s.handle_message(P.dumps({"type": "conversation.item.create", "item": {
                    "type": "message", "role": "user", "content": [{"type": "input_text", "text": f"hi {i} {turn}"}]}}))
                s.handle_message(P.dumps({"type": "response.create"}))
            for _ in range(1000):
                if all(sum(e["type"] == "response.done" for e in o) == turn + 1 for o in outs):
                    break
                await asyncio.sleep(0.01)
        for o in outs:
            done = [e for e in o if e["type"] == "response.done"]
            assert [d["response"]["status"] for d in done] == ["completed", "completed"]
            deltas = [e for e in o if e["type"] == "response.audio_transcript.delta"]
            assert len(deltas) == 12 and all(d["delta"].startswith(" t") for d in deltas)
        sessions[0].handle_message(P.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(960)).decode()}))
        assert sessions[0].backend.counters() == {"ignored_audio_chunks": 1}, outs[0][-1]  # type: ignore[attr-defined]
        for s in sessions:
            await s.close()
    run(go(), timeout=120)
