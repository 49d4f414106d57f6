"""Memory after session churn: closed sessions leave nothing referenced, and the heap is trimmed
once the open sessions fall (tristream.serve.memtrim; docs/serve-memory.md)."""

from __future__ import annotations

import asyncio
import gc
import json
from collections import Counter
from typing import Any

import pytest
from websockets.asyncio.client import connect

from tests.serve.helpers import TOKEN, run, running_server, url
from tristream.serve import memtrim
from tristream.serve.echo import EchoBackend
from tristream.serve.limits import ServerLimits
from tristream.serve.memtrim import MemoryTrimmer
from tristream.serve.server import RealtimeServer

AUTH = {"Authorization": f"Bearer {TOKEN}"}
# websockets' ServerProtocol is not among them: it refers to itself through its parser generator
# (websockets' own design) and is left to the collector, with the asyncio transport (idem).
PER_SESSION = ("RealtimeSession", "EchoBackend", "_Conn", "ServerConnection", "_Response")


async def _until(ws: Any, kind: str) -> None:
    for _ in range(500):
        if json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == kind:
            return
    raise AssertionError(f"no {kind}")


async def _session(u: str) -> Any:
    """Open a session and do one text turn; returns the open connection."""
    ws = await connect(u, additional_headers=AUTH)
    await _until(ws, "session.created")
    await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "be brief"}}))
    await _until(ws, "session.updated")
    await ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}))
    await ws.send(json.dumps({"type": "response.create"}))
    await _until(ws, "response.done")
    return ws


def _live(names: tuple[str, ...]) -> dict[str, int]:
    """Tracked objects of these types, garbage not yet collected included (no collection here)."""
    counts = Counter(type(o).__name__ for o in gc.get_objects())
    return {n: counts.get(n, 0) for n in names}


async def _wave(srv: Any, n: int) -> None:
    """`n` sessions open at once, one text turn each, then all closed (and their handlers done)."""
    conns = await asyncio.gather(*(_session(url(srv)) for _ in range(n)))
    assert len(srv.conns) == n
    await asyncio.gather(*(c.close() for c in conns))
    for _ in range(500):
        if not srv.conns:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the handlers' last steps after leaving the table


def test_closed_sessions_are_freed_without_the_garbage_collector() -> None:
    """Closed sessions, their backends, outboxes and connections are freed by reference counting
    as their handler ends: with the cyclic collector off, none is left after 60 sessions. (They
    were in reference cycles: every closed session waited for a full collection, which never
    comes while the server is idle; docs/serve-memory.md.) Metric series and dict entries do not
    grow with the number of sessions; the turn history is bounded."""
    async def go() -> None:
        async with running_server(limits=ServerLimits(max_sessions=64, memory_trim_s=0)) as srv:
            await _wave(srv, 4)
            counters = len(srv.metrics.counters)
            gc.collect()
            gc.disable()
            try:
                for _ in range(3):
                    await _wave(srv, 20)
                left = _live(PER_SESSION)
            finally:
                gc.enable()
            assert left == {k: 0 for k in PER_SESSION}, f"closed sessions still in memory: {left}"
            assert srv.conns == {} and not srv._bg
            assert len(srv.metrics.counters) == counters, "metric series grow with sessions"
            assert "session=" not in srv.metrics.render()  # no series left for closed sessions
            assert len(srv.turns) == 64
    run(go(), timeout=60)


def test_backend_failing_to_close_still_frees_the_session() -> None:
    """A backend whose close() raises: the client still gets a close frame, and the session leaves
    the table (it used to stay there, counting against max_sessions forever)."""
    class BadClose(EchoBackend):
        async def close(self) -> None:
            await super().close()
            raise RuntimeError("close failed")

    async def go() -> None:
        lim = ServerLimits(max_sessions=2, memory_trim_s=0)
        srv = RealtimeServer(lambda: BadClose(), host="127.0.0.1", port=0, tokens=[TOKEN], limits=lim)
        await srv.start()
        try:
            for _ in range(4):  # twice the session limit, one after another
                ws = await _session(url(srv))
                await ws.close()
                for _ in range(200):
                    if not srv.conns:
                        break
                    await asyncio.sleep(0.01)
                assert srv.conns == {}
        finally:
            await srv.stop(grace_s=0.0)
    run(go(), timeout=30)


class _Loop:
    """`call_later` recorded instead of scheduled: the test runs the checks itself."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, Any]] = []

    def call_later(self, delay: float, fn: Any) -> Any:
        self.calls.append((delay, fn))
        return self

    def cancel(self) -> None:
        pass


def _trimmer(check_s: float = 2.0, min_sessions: int = 8) -> tuple[MemoryTrimmer, list[int]]:
    trims: list[int] = []

    def trim() -> bool:
        trims.append(1)
        return True

    return MemoryTrimmer(check_s, min_sessions, trim=trim, rss=lambda: 1000), trims


def test_trimmer_trims_once_sessions_fall_to_half_of_peak() -> None:
    t, trims = _trimmer()
    loop = _Loop()
    for n in range(1, 101):
        t.opened(n)
    for n in range(99, 60, -1):  # 100 -> 61: not yet half
        t.closed(n, loop)
    assert loop.calls == [] and trims == []
    t.closed(50, loop)
    t.closed(49, loop)
    assert len(loop.calls) == 1 and loop.calls[0][0] == 2.0  # one check pending, not one per close
    loop.calls.pop()[1]()
    assert trims == [1] and t.trims == 1 and t.peak == 49
    assert ("tristream_memory_trims_total", {}, 1.0) in t.families()[0][3]


def test_trimmer_ramp_down_trims_logarithmically_and_steady_churn_never() -> None:
    t, trims = _trimmer(min_sessions=8)
    loop = _Loop()
    for n in range(1, 1025):
        t.opened(n)
    for n in range(1023, -1, -1):
        t.closed(n, loop)
        while loop.calls:  # the check runs at once (every close is "2 s later")
            loop.calls.pop()[1]()
    assert 1 <= len(trims) <= 8, trims  # 1024 -> 512 -> ... until the drop is under 8 sessions
    before = len(trims)
    for _ in range(1000):  # steady churn around 30 sessions reuses the memory it frees
        t.opened(31)
        t.closed(30, loop)
        while loop.calls:
            loop.calls.pop()[1]()
    assert len(trims) == before


def test_trimmer_off() -> None:
    t, trims = _trimmer(check_s=0)
    loop = _Loop()
    t.opened(100)
    t.closed(0, loop)
    assert not t.enabled and loop.calls == [] and trims == []


def test_no_glibc_is_graceful(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memtrim, "_trim_fn", None)  # as where the C library has no malloc_trim
    assert memtrim.malloc_trim() is None and not memtrim.trim_available()
    t = MemoryTrimmer(2.0, 1)
    loop = _Loop()
    t.opened(10)
    t.closed(0, loop)
    assert not t.enabled and loop.calls == []


def test_server_trims_after_sessions_close() -> None:
    """A real server: 12 sessions open at once, then closed -> one trim shortly after."""
    if not memtrim.trim_available():
        pytest.skip("no glibc malloc_trim here")
    assert memtrim.malloc_trim() in (True, False)

    async def go() -> None:
        lim = ServerLimits(max_sessions=64, memory_trim_s=0.05, memory_trim_min_sessions=8)
        async with running_server(limits=lim) as srv:
            assert srv.trimmer.trims == 0
            await _wave(srv, 12)
            for _ in range(200):
                if srv.trimmer.trims:
                    break
                await asyncio.sleep(0.01)
            assert srv.trimmer.trims >= 1 and srv.trimmer.peak == 0
            assert "tristream_memory_trims_total" in srv.metrics.render()
    run(go(), timeout=60)


def test_memory_trim_setting_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRISTREAM_MEMORY_TRIM_S", "0")
    assert ServerLimits().memory_trim_s == 0.0
    monkeypatch.setenv("TRISTREAM_MEMORY_TRIM_S", "bogus")
    assert ServerLimits().memory_trim_s == 2.0
