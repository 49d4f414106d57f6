"""Shared helpers for the serving tests: a server on loopback (in-process, or the real
`tristream serve` process) and synthetic speech-like audio."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench._common import ServerDidNotStart, stop_process, wait_healthy
from tristream.serve.echo import EchoBackend
from tristream.serve.limits import ServerLimits
from tristream.serve.server import RealtimeServer

TOKEN = "test-token-123"


def tone_turns(durations_ms: list[int], rate: int = 24_000, gap_ms: int = 800, freq: float = 300.0) -> np.ndarray:
    """Voiced bursts (a tone at ~-16 dBFS) of the given lengths separated by silence."""
    parts = [np.zeros(rate * 200 // 1000, dtype=np.int16)]
    for i, d in enumerate(durations_ms):
        t = np.arange(rate * d // 1000) / rate
        parts.append((np.sin(2 * np.pi * (freq + 20 * i) * t) * 5000).astype(np.int16))
        parts.append(np.zeros(rate * gap_ms // 1000, dtype=np.int16))
    return np.concatenate(parts)


@contextlib.asynccontextmanager
async def serving(factory: Callable[[], Any], **kw: Any) -> AsyncIterator[RealtimeServer]:
    """A `RealtimeServer` of `factory`'s backends on 127.0.0.1 with a free port, stopped on exit;
    it takes `TOKEN` unless ``tokens`` is given, and the other keywords of `RealtimeServer`."""
    kw.setdefault("tokens", [TOKEN])
    srv = RealtimeServer(factory, host="127.0.0.1", port=0, **kw)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(grace_s=0.0)


def running_server(tmp: Path | None = None, pace: float = 0.0,
                   **kw: Any) -> contextlib.AbstractAsyncContextManager[RealtimeServer]:
    """An EchoBackend server (answering at `pace`, recording to `tmp`) as `serving` gives it."""
    limits = kw.pop("limits", None) or ServerLimits()
    return serving(lambda: EchoBackend(pace=pace), limits=limits, record_dir=tmp, **kw)


@contextlib.contextmanager
def serve_process(token: str, port: int, *args: str) -> Iterator[subprocess.Popen[str]]:
    """`tristream serve --token token --port port *args` as its own process, without the
    environment's ``TRISTREAM_TOKEN``; entered once it answers ``/healthz`` (the test fails with
    the server's stderr when it exits first), stopped on exit."""
    env = {k: v for k, v in os.environ.items() if k != "TRISTREAM_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-m", "tristream.cli", "serve", "--token", token, "--port", str(port),
                             *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        try:
            wait_healthy(proc, port, output=lambda: proc.stderr.read() if proc.stderr else "")
        except ServerDidNotStart as exc:
            pytest.fail(str(exc))
        yield proc
    finally:
        stop_process(proc)


def url(srv: RealtimeServer) -> str:
    """The WebSocket URL of a running server."""
    return f"ws://127.0.0.1:{srv.port}/v1/realtime"


def run(coro: object, timeout: float = 30.0) -> object:
    """Run a coroutine with a hard timeout (tests never hang)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))  # type: ignore[arg-type]


class _CountedGraph:
    """A captured CUDA graph whose replays are counted; everything else goes to the graph."""

    def __init__(self, g: Any, counter: dict[str, int]) -> None:
        self.g, self.counter = g, counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self.g, name)

    def replay(self) -> None:
        self.counter["n"] += 1
        self.g.replay()


def count_replays(graphs: MutableMapping[Any, Any]) -> dict[str, int]:
    """Wrap every graph of `graphs` in place; the returned dict's "n" counts their replays."""
    counter = {"n": 0}
    for key in list(graphs):
        graphs[key] = _CountedGraph(graphs[key], counter)
    return counter
