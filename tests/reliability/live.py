"""Loopback helpers for the reliability tests and `bench/reliability.py`: clients that
speak the Realtime protocol, abrupt TCP resets, and server-side resource snapshots."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from tristream.serve.server import RealtimeServer

IGNORED = {"event_id", "id", "item_id", "response_id", "previous_item_id", "x_tristream", "session", "response",
           "item"}


def normalise(ev: dict[str, Any]) -> tuple[str, str]:
    """An event without ids and latency fields: what two runs of one session must share."""
    body = {k: v for k, v in ev.items() if k not in IGNORED and k != "type"}
    if ev["type"] == "response.done":
        body["status"] = ev["response"]["status"]
    return ev["type"], json.dumps(body, sort_keys=True)


def rss_mb() -> float:
    """This process's resident set size in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def open_fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def tcp_reset(ws: ClientConnection) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), no close frame."""
    sock = ws.transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.transport.abort()


async def until(pred: Callable[[], bool], timeout_s: float, poll_s: float = 0.01) -> float:
    """Wait until `pred()` holds; return the seconds it took (raises TimeoutError after `timeout_s`)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not pred():
        if loop.time() - t0 > timeout_s:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(poll_s)
    return loop.time() - t0


async def text_turn(ws: ClientConnection, text: str, disturb: str | None = None) -> list[tuple[str, str]]:
    """Send one text item + response.create; read until response.done (or disturb mid-answer).

    disturb: None, ``cancel`` (response.cancel after the first delta), ``close`` (clean close
    mid-answer) or ``reset`` (TCP RST mid-answer). Returns the normalised events seen.
    """
    await ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
    await ws.send(json.dumps({"type": "response.create"}))
    seen: list[tuple[str, str]] = []
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), 20))
        seen.append(normalise(ev))
        if ev["type"] in ("response.text.delta", "response.audio_transcript.delta") and disturb:
            if disturb == "cancel":
                await ws.send(json.dumps({"type": "response.cancel"}))
                disturb = None
            elif disturb == "close":
                await ws.close()
                return seen
            elif disturb == "reset":
                tcp_reset(ws)
                return seen
        if ev["type"] == "response.done":
            return seen


def server_resources(srv: RealtimeServer) -> dict[str, int]:
    """Server-side resources that must return to baseline: sessions, outboxes, background tasks."""
    return {"sessions": len(srv.conns), "bg_tasks": len(srv._bg),
            "outbox_events": sum(c.outbox.qsize() for c in srv.conns.values())}


async def connect_auth(u: str, token: str, **kw: Any) -> ClientConnection:
    """Connect with a bearer token and read `session.created`."""
    ws = await connect(u, additional_headers={"Authorization": f"Bearer {token}"}, **kw)
    first = json.loads(await ws.recv())
    assert first["type"] == "session.created", first
    return ws
