"""``--backend engine`` on a CPU: turns on our `LLMEngine` through the cross-session scheduler,
behind the real server on loopback.

The model is a tiny Llama with random weights (no tokenizer: answers are token ids as text,
``" t<id>"``): what is checked is the path (scheduler plans every prefill and decode token,
tiers, sheds reaching the client, cancellation), not the language. The same code runs on a
GPU with CUDA graphs (`test_engine_backend_gpu.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from typing import Any

import pytest

from tests.serve.helpers import TOKEN, run, serving, url
from tristream.sched.admission import QueuePolicy
from tristream.sched.config import ours_config
from tristream.sched.types import Kind, Tier, WorkModality
from tristream.serve.client import RealtimeClient
from tristream.serve.server import RealtimeServer

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def factory() -> Any:
    from tristream.serve.sched_backend import engine_factory

    f = engine_factory(model="tiny-random", device="cpu", max_tokens=MAX_TOKENS)
    yield f
    f.engine.shutdown()


async def ask(c: RealtimeClient, text: str, timeout: float = 30.0) -> tuple[list[dict[str, Any]], float]:
    """One text turn; returns the events up to response.done and ms from response.create to the first
    text delta (or to the error)."""
    await c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                              "content": [{"type": "input_text", "text": text}]}})
    t0 = time.perf_counter()
    await c.send({"type": "response.create"})
    evs: list[dict[str, Any]] = []
    first = -1.0
    while True:
        ev = await c.recv(timeout)
        evs.append(ev)
        if first < 0 and ev["type"] in ("response.text.delta", "error"):
            first = (time.perf_counter() - t0) * 1000
        if ev["type"] == "response.done":
            return evs, first


def text_of(evs: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in evs if e["type"] == "response.text.delta")


def test_text_turns_of_concurrent_clients_run_through_the_scheduler(factory: Any) -> None:
    se = factory.engine
    steps0, decode0 = se.steps, se.executor.decode_tokens

    async def client(srv: RealtimeServer, k: int) -> list[str]:
        c = await RealtimeClient.connect(url(srv), TOKEN)
        await c.send({"type": "session.update", "session": {"modalities": ["text"]}})
        await c.recv(5)
        out = []
        for turn in range(2):
            evs, _ = await ask(c, f"client {k} turn {turn}")
            assert evs[-1]["response"]["status"] == "completed", evs[-1]
            out.append(text_of(evs))
        await c.close()
        return out

    async def go() -> None:
        async with serving(factory) as srv:
            answers = await asyncio.gather(*(client(srv, k) for k in range(4)))
            metrics = srv.metrics.render()
        for per_client in answers:
            for a in per_client:
                assert re.fullmatch(r"( t\d+){" + str(MAX_TOKENS) + "}", a), a  # every token planned, none lost
        assert "tristream_sched_steps_total" in metrics
    run(go(), timeout=60)
    # the first token of each answer comes with its TURN_END prefill, the others are planned DECODE items
    assert se.executor.decode_tokens - decode0 == 8 * (MAX_TOKENS - 1)
    assert se.steps > steps0
    assert se.sched.ledger.events["answers_completed"] >= 8


def test_tier_from_token_caps_session_update(factory: Any) -> None:
    se = factory.engine

    async def go() -> None:
        async with serving(factory, tokens=[f"{TOKEN}@bronze", "goldtok@gold"]) as srv:
            c = await RealtimeClient.connect(url(srv), TOKEN)
            assert c.session["tier"] == "bronze"
            await c.send({"type": "session.update", "session": {"tier": "gold"}})
            err = await c.recv(5)
            assert err["type"] == "error" and err["error"]["code"] == "tier_not_allowed"
            n0 = len(se.sched.turns)
            evs, _ = await ask(c, "hi")
            assert evs[-1]["response"]["status"] == "completed"
            g = await RealtimeClient.connect(url(srv), "goldtok")
            assert g.session["tier"] == "gold"
            evs, _ = await ask(g, "hi")
            await g.send({"type": "session.update", "session": {"tier": "silver"}})  # lowering is allowed
            assert (await g.recv(5))["session"]["tier"] == "silver"
            evs, _ = await ask(g, "hi again")
            assert evs[-1]["response"]["status"] == "completed"
            tiers = [(r.tier, r.modality) for r in se.sched.turns[n0:]]
            assert tiers == [(Tier.BRONZE, WorkModality.TEXT), (Tier.GOLD, WorkModality.TEXT), (Tier.SILVER, WorkModality.TEXT)]
            await c.close()
            await g.close()
    run(go(), timeout=60)


def test_sheds_reach_the_client_as_errors_and_sessions_go_on() -> None:
    from tristream.serve.sched_backend import engine_factory

    base = ours_config()
    queue = dict(base.queue)
    queue[Tier.BRONZE] = QueuePolicy(max_queue_size=64, timeouts_ms={Kind.TURN_END: -1.0})  # always late
    queue[Tier.SILVER] = QueuePolicy(max_queue_size=0)  # always full
    f = engine_factory(model="tiny-random", device="cpu", max_tokens=4,
                       scheduler=dataclasses.replace(base, queue=queue))

    async def go() -> dict[str, float]:
        waits = {}
        async with serving(f) as srv:
            for tier, reason in (("bronze", "timeout"), ("silver", "queue_full"), ("gold", "")):
                c = await RealtimeClient.connect(url(srv), TOKEN)
                await c.send({"type": "session.update", "session": {"tier": tier, "modalities": ["text"]}})
                await c.recv(5)
                evs, waits[tier] = await ask(c, "are you there")
                done = evs[-1]["response"]
                if reason:
                    errs = [e for e in evs if e["type"] == "error"]
                    assert len(errs) == 1 and errs[0]["error"]["code"] == "scheduler_shed", evs
                    assert reason in errs[0]["error"]["message"] and tier in errs[0]["error"]["message"]
                    assert done["status"] == "failed" and done["status_details"]["reason"] == f"shed:{reason}"
                else:
                    assert done["status"] == "completed"
                await c.send({"type": "session.update", "session": {"tier": "gold"}})  # the session goes on
                await c.recv(5)
                evs, _ = await ask(c, "again")
                assert evs[-1]["response"]["status"] == "completed"
                await c.close()
            metrics = srv.metrics.render()
        assert 'tristream_sched_shed_total{kind="turn_end",reason="timeout",tier="bronze"} 1' in metrics
        assert 'tristream_sched_shed_total{kind="turn_end",reason="queue_full",tier="silver"} 1' in metrics
        return waits
    try:
        waits = run(go(), timeout=60)
    finally:
        f.engine.shutdown()
    print("response.create -> error/first text ms:", waits)  # timed in bench/serve.py, not asserted here


def test_cancel_stops_the_answer_and_frees_the_turn() -> None:
    from tristream.serve.sched_backend import engine_factory

    f = engine_factory(model="tiny-random", device="cpu", max_tokens=200)  # ~10 s at the 50 ms decode pace

    async def go() -> None:
        async with serving(f) as srv:
            c = await RealtimeClient.connect(url(srv), TOKEN)
            await c.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "long"}]}})
            await c.send({"type": "response.create"})
            while (await c.recv(10))["type"] not in ("response.text.delta", "response.audio_transcript.delta"):
                pass
            await c.send({"type": "response.cancel"})
            while (ev := await c.recv(10))["type"] != "response.done":
                pass
            assert ev["response"]["status"] == "cancelled"
            await c.send({"type": "session.update", "session": {}})  # a round trip: the cancel reached the engine
            await c.recv(5)
            for _ in range(100):
                if not f.engine.executor.turns and not f.engine.engine.seqs:
                    break
                await asyncio.sleep(0.01)
            assert not f.engine.executor.turns and not f.engine.engine.seqs  # blocks freed
            assert f.engine.counters.get("answers_cancelled") == 1
            await c.close()
    try:
        run(go(), timeout=60)
    finally:
        f.engine.shutdown()


@pytest.mark.slow
def test_spoken_turns_through_the_scheduler_with_embedded_stages(pipeline_models: Any) -> None:
    """``stages=embedded``: real VAD / Whisper / piper around the scheduled engine."""
    from tests.serve.pipeline_helpers import SENTENCES, speech
    from tristream.sched.real import build_engine
    from tristream.sched.scheduled_engine import ScheduledEngine
    from tristream.serve.client import stream_media
    from tristream.serve.pipeline_backend import PipelineBackend
    from tristream.serve.sched_backend import ScheduledChat

    se = ScheduledEngine(build_engine("tiny-random", "cpu", 64 << 20))
    pcm = speech(pipeline_models, SENTENCES[1])

    async def go() -> list[Any]:
        async with serving(lambda: PipelineBackend(
                pipeline_models, chat_for_session=lambda t: ScheduledChat(se, t, max_tokens=3))) as srv:
            return await stream_media(url(srv), TOKEN, pcm, 24_000, pace=0, expect_turns=1, tail_silence_s=0.5,
                                      answer_timeout_s=60)
    try:
        res = run(go(), timeout=120)
    finally:
        se.shutdown()
    assert res[0].status == "completed" and res[0].audio_samples > 0
    assert "weather" in res[0].transcript.lower()
    assert re.fullmatch(r"( t\d+)+", res[0].answer), res[0].answer
    assert [(r.tier, r.modality) for r in se.sched.turns] == [(Tier.SILVER, WorkModality.SPEECH)]


@pytest.mark.slow
def test_embedded_family_exports_scheduler_stage_and_recogniser_metrics() -> None:
    """``engine_factory(stages="embedded")``: the family's ``collect`` carries the scheduler's,
    the closed sessions' stage totals and the shared CPU recogniser's counters, as the default
    assistant's does; ``healthy`` follows the engine thread."""
    from tristream.serve.sched_backend import engine_factory

    f = engine_factory("tiny-random", "cpu", stages="embedded")
    try:
        names = {name for name, *_ in f.collect()}
        assert {"tristream_sched_counter", "tristream_asr_counter"} <= names, names
        assert any(n.startswith("tristream_stage") for n in names), names
        assert f.healthy() and f.scheduler is f.engine.sched
    finally:
        f.engine.shutdown()
