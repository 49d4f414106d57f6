"""Issue 9 item 4 (fast form): an exception inside the engine step after N calls.

The real `EngineChatBackend` thread over `FaultyEngine`: every answer in flight ends with an
error within 2 s, readiness is false until the engine recovers (time to recovery reported),
the engine holds no sequence afterwards, and new answers work. Then the same through the
real embedded pipeline behind a live server: `error` events, `response.done` failed,
``/readyz`` 503 while broken, and the session goes on.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

from tests.reliability.faults import FaultyEngine
from tests.reliability.live import connect_auth, until
from tests.serve.helpers import TOKEN, run, url
from tristream.pipeline.llm import EngineChatBackend, EngineStepError


async def _collect(chat: EngineChatBackend, i: int) -> tuple[str, BaseException | None, float]:
    t0 = time.perf_counter()
    text = ""
    try:
        async for d in chat.stream([{"role": "user", "content": f"q{i}"}], 64):
            text += d
    except EngineStepError as exc:
        return text, exc, time.perf_counter() - t0
    return text, None, time.perf_counter() - t0


def test_engine_step_fault_fails_every_answer_in_flight_then_recovers() -> None:
    eng = FaultyEngine(tokens_per_answer=400, fail_after=20, broken_steps=3)
    chat = EngineChatBackend(eng)

    async def go() -> None:
        outs = await asyncio.wait_for(asyncio.gather(*(_collect(chat, i) for i in range(8))), 10)
        assert all(isinstance(err, EngineStepError) for _, err, _ in outs)  # every affected answer: an error
        assert all(t < 2.0 for _, _, t in outs)
        assert all("injected fault" in str(err) for _, err, _ in outs)
        await until(lambda: chat.healthy and eng.live == 0, 2.0)  # recovered, sequences freed
        assert 1 <= chat.errors <= 3 and len(chat.recoveries_s) == 1 and chat.recoveries_s[0] < 2.0
        text, err, _ = await asyncio.wait_for(_collect(chat, 99), 10)  # the engine serves again
        assert err is None and text.endswith(" t64")
    run(go(), timeout=30)


def _get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_pipeline_engine_fault_errors_sessions_readiness_and_recovery(pipeline_models: object) -> None:
    from tristream.serve.backend import BackendFamily
    from tristream.serve.limits import ServerLimits
    from tristream.serve.pipeline_backend import PipelineBackend
    from tristream.serve.server import RealtimeServer

    models, eng = pipeline_models  # type: ignore[misc]
    chat = models.llm

    factory = BackendFamily(lambda: PipelineBackend(models), healthy=lambda: chat.healthy)  # as pipeline_factory

    async def ask(ws: object, text: str) -> list[dict]:
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {  # type: ignore[attr-defined]
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
        await ws.send(json.dumps({"type": "response.create", "response": {"modalities": ["text"]}}))  # type: ignore[attr-defined]
        evs = []
        while True:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 20))  # type: ignore[attr-defined]
            evs.append(ev)
            if ev["type"] == "response.done":
                return evs

    async def go() -> None:
        srv = RealtimeServer(factory, port=0, tokens=[TOKEN], limits=ServerLimits(max_sessions=8))
        await srv.start()
        loop = asyncio.get_running_loop()
        try:
            wss = [await connect_auth(url(srv), TOKEN) for _ in range(4)]
            for ws in wss:
                await ws.send(json.dumps({"type": "session.update", "session": {"modalities": ["text"]}}))
            ok = await asyncio.gather(*(ask(ws, "hello") for ws in wss))
            assert all(e[-1]["response"]["status"] == "completed" for e in ok)
            eng.fail_after, eng.broken_steps, eng.failures = eng.calls, 10**9, 0  # persistent fault
            t0 = time.perf_counter()
            failed = await asyncio.gather(*(ask(ws, "hello again") for ws in wss))
            t_err = time.perf_counter() - t0
            for evs in failed:
                errs = [e for e in evs if e["type"] == "error"]
                assert errs and errs[0]["error"]["code"] == "server_error", evs
                assert evs[-1]["response"]["status"] == "failed"
            assert t_err < 2.0
            assert await loop.run_in_executor(None, _get, srv.port, "/readyz") == 503
            await until(lambda: eng.failures >= 3, 3.0)  # idle, still broken: probes fail, not ready
            assert not chat.healthy
            assert await loop.run_in_executor(None, _get, srv.port, "/readyz") == 503
            assert await loop.run_in_executor(None, _get, srv.port, "/healthz") == 200
            eng.broken_steps = eng.failures  # the fault clears; the engine thread recovers alone
            t1 = time.perf_counter()
            await until(lambda: chat.healthy, 3.0)
            recovery = time.perf_counter() - t1
            assert await loop.run_in_executor(None, _get, srv.port, "/readyz") == 200
            again = await asyncio.gather(*(ask(ws, "and now") for ws in wss))
            assert all(e[-1]["response"]["status"] == "completed" for e in again)
            assert eng.live == 0 and recovery < 3.0
            for ws in wss:
                await ws.close()
        finally:
            await srv.stop(grace_s=0.0)
    run(go(), timeout=90)
