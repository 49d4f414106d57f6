"""Issue 9 item 3 (fast form): cancel / close / TCP-reset 10% of 100 live sessions mid-answer.

The other 90 must get exactly the events of an undisturbed run (ids aside), and the server's
sessions, outboxes and tasks must be back to baseline within 1 s.
"""

from __future__ import annotations

import asyncio

from tests.reliability.live import connect_auth, server_resources, text_turn, until
from tests.serve.helpers import TOKEN, run, url
from tristream.serve.echo import EchoBackend
from tristream.serve.limits import ServerLimits
from tristream.serve.server import RealtimeServer

N = 100
DISTURB = {i: ("cancel", "close", "reset")[j % 3] for j, i in enumerate(range(3, N, 10))}  # 10 of 100


def words(i: int) -> str:
    return " ".join(f"w{i}_{k}" for k in range(12))


async def one_run(disturbed: bool) -> tuple[dict[int, list[tuple[str, str]]], dict[str, float]]:
    srv = RealtimeServer(lambda: EchoBackend(pace=0.3), port=0, tokens=[TOKEN],
                         limits=ServerLimits(max_sessions=N + 10))
    await srv.start()
    try:
        base_tasks = len(asyncio.all_tasks())
        wss = await asyncio.gather(*(connect_auth(url(srv), TOKEN) for _ in range(N)))
        outs = await asyncio.gather(*(text_turn(ws, words(i), DISTURB.get(i) if disturbed else None)
                                      for i, ws in enumerate(wss)))
        figs: dict[str, float] = {}
        for i, ws in enumerate(wss):
            if i not in DISTURB or not disturbed or DISTURB[i] == "cancel":
                await ws.close()
        figs["sessions_back_s"] = await until(lambda: server_resources(srv)["sessions"] == 0, 1.0)
        figs["tasks_back_s"] = await until(lambda: len(asyncio.all_tasks()) <= base_tasks, 1.0)
        assert server_resources(srv) == {"sessions": 0, "bg_tasks": 0, "outbox_events": 0}
        return dict(enumerate(outs)), figs
    finally:
        await srv.stop(grace_s=0.0)


def test_ten_percent_disturbed_others_unchanged_resources_back() -> None:
    async def go() -> None:
        ref, _ = await one_run(False)
        got, figs = await one_run(True)
        for i in range(N):
            if i in DISTURB:
                continue
            assert got[i] == ref[i], f"session {i} differs from the undisturbed run"
        for i, how in DISTURB.items():
            if how == "cancel":
                assert got[i][-1][0] == "response.done" and '"cancelled"' in got[i][-1][1]
        assert figs["sessions_back_s"] <= 1.0 and figs["tasks_back_s"] <= 1.0
        assert all(ref[i][-1][0] == "response.done" for i in range(N))
    run(go(), timeout=60)
