"""Issue 9 item 3 on the real engine: cancel / close / TCP-reset 10% of 100 live sessions whose
answers run on `LLMEngine` (tiny random Llama, CPU) through the scheduler (``--backend engine``).

Shared by `test_cancel_disconnect_engine.py` and `bench/reliability.py`. Baseline, besides the
server's sessions and tasks: the engine's sequences and free KV blocks (`BlockManager`), the
turn executor's turns, the scheduled engine's answers in flight and the scheduler's sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from typing import Any

from websockets.protocol import State

from tests.reliability.live import connect_auth, server_resources, text_turn, until
from tests.serve.helpers import TOKEN, url
from tristream.serve.limits import ServerLimits
from tristream.serve.server import RealtimeServer

N = 100
DISTURB = {i: ("cancel", "close", "reset")[j % 3] for j, i in enumerate(range(3, N, 10))}  # 10 of 100


def engine_resources(factory: Any) -> dict[str, int]:
    """Engine-side state that must return to baseline (read from the loop; the engine thread owns it)."""
    se = factory.engine
    eng = se.engine
    return {"engine_sequences": len(eng.seqs), "kv_blocks_used": eng.blocks.num_blocks - eng.blocks.num_free,
            "executor_turns": len(se.executor.turns), "answers_in_flight": len(se.handles),
            "scheduler_sessions": len(se.sched.sessions)}


def make_factory(max_tokens: int = 24, target_factor: float = 1000.0) -> Any:
    """The ``engine`` backend factory on the tiny random model (one engine, loaded once).

    The tiers' targets are ``target_factor`` times the GPU ones: this is about cancel and
    disconnect, not overload, so a slow or busy CI core must not make the degradation ladder
    refuse or shed turns (that would make two runs differ for reasons unrelated to the test).
    """
    from tristream.serve.sched_backend import engine_factory, scaled_config

    return engine_factory(model="tiny-random", device="cpu", max_tokens=max_tokens,
                          scheduler=scaled_config(target_factor))


def words(i: int) -> str:
    return " ".join(f"w{i}_{k}" for k in range(12))


async def one_run(factory: Any, disturbed: bool) -> tuple[dict[int, list[tuple[str, str]]], dict[str, Any]]:
    """One run of N sessions (one turn each); returns their events and the baseline figures."""
    srv = RealtimeServer(factory, port=0, tokens=[TOKEN], limits=ServerLimits(max_sessions=N + 10))
    await srv.start()
    try:
        base_tasks = len(asyncio.all_tasks())
        base_engine = engine_resources(factory)
        wss = await asyncio.gather(*(connect_auth(url(srv), TOKEN) for _ in range(N)))
        outs = await asyncio.gather(*(text_turn(ws, words(i), DISTURB.get(i) if disturbed else None)
                                      for i, ws in enumerate(wss)))
        for ws in wss:  # a disturbed session whose answer ended before its first delta is still open
            if ws.state is State.OPEN:
                await ws.close()
        figs: dict[str, Any] = {"engine_baseline": base_engine}
        figs["sessions_back_s"] = await until(lambda: server_resources(srv)["sessions"] == 0, 5.0)
        figs["tasks_back_s"] = await until(lambda: len(asyncio.all_tasks()) <= base_tasks, 5.0)
        t0 = time.perf_counter()
        with contextlib.suppress(TimeoutError):
            await until(lambda: engine_resources(factory) == base_engine, 5.0)
        figs["engine_back_s"] = time.perf_counter() - t0
        figs["engine_after"] = engine_resources(factory)
        figs["engine_back"] = figs["engine_after"] == base_engine
        figs["server_after"] = server_resources(srv)
        return dict(enumerate(outs)), figs
    finally:
        await srv.stop(grace_s=0.0)


async def lone_disturbed(factory: Any, how: str) -> dict[str, Any]:
    """One session alone, disturbed mid-answer (``cancel``, ``close``, ``reset``) with no other traffic
    to drive engine steps: how long until the engine's state is back at its baseline."""
    srv = RealtimeServer(factory, port=0, tokens=[TOKEN])
    await srv.start()
    try:
        base = engine_resources(factory)
        ws = await connect_auth(url(srv), TOKEN)
        seen = await text_turn(ws, "hello " * 50, how)
        t0 = time.perf_counter()
        during = engine_resources(factory)
        def engine_free() -> bool:  # after a cancel the session (and its scheduler state) stays open
            now = engine_resources(factory)
            return all(now[k] == base[k] for k in now if k != "scheduler_sessions") and \
                now["scheduler_sessions"] <= base["scheduler_sessions"] + int(how == "cancel")
        with contextlib.suppress(TimeoutError):
            await until(engine_free, 5.0)
        back_s = time.perf_counter() - t0
        after = engine_resources(factory)
        if how == "cancel":
            await ws.close()
            await until(lambda: server_resources(srv)["sessions"] == 0, 5.0)
        with contextlib.suppress(TimeoutError):
            await until(lambda: engine_resources(factory) == base, 5.0)
        return {"how": how, "last_event": seen[-1], "state_right_after": during, "state_after": after,
                "back_s": back_s, "final": engine_resources(factory), "baseline": base}
    finally:
        await srv.stop(grace_s=0.0)


async def cancel_while_refusing(factory: Any) -> dict[str, Any]:
    """``response.cancel`` while the degradation ladder refuses new sessions of the session's tier.

    `ScheduledEngine._cancel` re-opens the scheduler session to drop queued work; that open can
    raise `SessionRefused`. Recorded: whether the engine thread survived and whether the
    session's next turn ends (answer or coded error) instead of hanging.
    """
    from tristream.sched.admission import Level

    se = factory.engine
    srv = RealtimeServer(factory, port=0, tokens=[TOKEN])
    await srv.start()
    try:
        ws = await connect_auth(url(srv), TOKEN)
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello " * 20}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        while json.loads(await asyncio.wait_for(ws.recv(), 20))["type"] != "response.audio_transcript.delta":
            pass
        se.sched.ladder.config = dataclasses.replace(se.sched.ladder.config, relax_after_ms=1e9)  # hold the level
        se.sched.ladder.level = Level.REFUSE_NEW_SESSIONS
        await ws.send(json.dumps({"type": "response.cancel"}))
        while json.loads(await asyncio.wait_for(ws.recv(), 20))["type"] != "response.done":
            pass
        await asyncio.sleep(0.2)
        alive = se._thread.is_alive()
        next_turn: Any
        try:
            seen = await asyncio.wait_for(text_turn(ws, "are you there"), 5.0)
            next_turn = seen[-1]
        except TimeoutError:
            next_turn = "hung (the turn did not end within 5 s)"
        await ws.close()
        return {"engine_thread_alive_after_cancel": alive, "next_turn_last_event": next_turn,
                "ladder_level": int(se.sched.ladder.level)}
    finally:
        await srv.stop(grace_s=0.0)
