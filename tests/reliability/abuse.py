"""Size and resource abuse (issue 9 item 7), shared by the tests and `bench/reliability.py`."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import time
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.reliability.live import rss_mb
from tristream.serve.server import RealtimeServer


def frame_header(length: int, opcode: int = 0x1, rsv1: bool = False, mask: bytes = b"\x01\x02\x03\x04") -> bytes:
    """A masked client frame header announcing `length` payload bytes."""
    b0 = 0x80 | (0x40 if rsv1 else 0) | opcode
    if length < 126:
        return bytes([b0, 0x80 | length]) + mask
    if length < 1 << 16:
        return bytes([b0, 0x80 | 126]) + struct.pack("!H", length) + mask
    return bytes([b0, 0x80 | 127]) + struct.pack("!Q", length) + mask


async def close_code_of(ws: ClientConnection, timeout_s: float = 5.0) -> int | None:
    """Wait for the server to close `ws`; its close code (None on an abrupt end)."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                await ws.recv()
    except ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd is not None else None


async def oversize(u: str, token: str, announce: int, stream_bytes: int) -> dict[str, Any]:
    """Announce a frame of `announce` bytes, stream up to `stream_bytes` of it; time to the close."""
    ws = await connect(u, additional_headers={"Authorization": f"Bearer {token}"})
    await ws.recv()
    rss0 = rss_mb()
    t0 = time.perf_counter()
    ws.transport.write(frame_header(announce))
    chunk = os.urandom(64 * 1024)
    sent = 0
    code: int | None = None
    while sent < stream_bytes and not ws.transport.is_closing():
        ws.transport.write(chunk)
        sent += len(chunk)
        await asyncio.sleep(0)
        if ws.state.name != "OPEN":
            break
    code = await close_code_of(ws)
    return {"close_code": code, "seconds_to_close": time.perf_counter() - t0, "bytes_streamed": sent,
            "rss_growth_mb": rss_mb() - rss0}


async def compressed_frame(u: str, token: str) -> dict[str, Any]:
    """Offer permessage-deflate, then send an RSV1 (compressed) frame anyway: must be refused."""
    ws = await connect(u, additional_headers={"Authorization": f"Bearer {token}"}, compression="deflate")
    await ws.recv()
    negotiated = ws.response.headers.get("Sec-WebSocket-Extensions") if ws.response else None
    import zlib

    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    payload = bomb.compress(b"\x00" * (64 << 20)) + bomb.flush(zlib.Z_SYNC_FLUSH)
    payload = payload[:-4]
    mask = b"\x01\x02\x03\x04"
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    t0 = time.perf_counter()
    ws.transport.write(frame_header(len(payload), rsv1=True, mask=mask) + masked)
    code = await close_code_of(ws)
    return {"extension_negotiated": negotiated, "bomb_compressed_bytes": len(payload),
            "bomb_inflated_bytes": 64 << 20, "close_code": code, "seconds_to_close": time.perf_counter() - t0}


async def idle_connections(srv: RealtimeServer, u: str, token: str, n: int, extra: int) -> dict[str, Any]:
    """Open `n` idle sessions (RSS per connection) then `extra` more (each must be refused)."""
    import gc

    gc.collect()
    rss0 = rss_mb()
    conns: list[ClientConnection] = []
    batch = 200
    for k in range(0, n, batch):
        conns += await asyncio.gather(*(connect(u, additional_headers={"Authorization": f"Bearer {token}"},
                                                open_timeout=60, ping_interval=None)
                                        for _ in range(min(batch, n - k))))
    assert len(srv.conns) == n, (len(srv.conns), n)
    rss1 = rss_mb()
    refused: list[int] = []
    for _ in range(extra):
        try:
            async with connect(u, additional_headers={"Authorization": f"Bearer {token}"}):
                refused.append(101)
        except InvalidStatus as e:
            refused.append(e.response.status_code)
    for i in range(0, len(conns), batch):
        await asyncio.gather(*(c.close() for c in conns[i:i + batch]))
    # both ends live in this process: client + server bytes per connection (an upper bound)
    return {"connections": n, "rss_mb_before": rss0, "rss_mb_open": rss1,
            "rss_kb_per_connection_both_ends": (rss1 - rss0) * 1024 / max(1, n),
            "extra_attempts": extra, "extra_statuses": sorted(set(refused)), "refused": sum(s == 503 for s in refused)}


async def slow_reader(srv: RealtimeServer, u: str, token: str, turns: int = 60) -> dict[str, Any]:
    """A client that never reads while asking for long audio answers; watch the server's buffers."""
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", srv.port))
    bad = await connect(u, additional_headers={"Authorization": f"Bearer {token}"}, sock=sock, max_size=None)
    await bad.send(json.dumps({"type": "session.update", "session": {"output_audio_sample_rate": 48_000}}))
    peak = {"outbox_events": 0, "write_buffer_bytes": 0}
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            for c in list(srv.conns.values()):
                peak["outbox_events"] = max(peak["outbox_events"], c.outbox.qsize())
                tr = c.ws.transport
                if tr is not None:
                    peak["write_buffer_bytes"] = max(peak["write_buffer_bytes"], tr.get_write_buffer_size())
            await asyncio.sleep(0.002)

    w = asyncio.get_running_loop().create_task(watch())
    text = " ".join(["word"] * 2000)
    closed_by_server = False
    try:
        for _ in range(turns):
            await bad.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
            await bad.send(json.dumps({"type": "response.create"}))
            await asyncio.sleep(0.02)
    except ConnectionClosed:
        closed_by_server = True
    closed_by_server = closed_by_server or srv.metrics.count("tristream_sessions_closed_total", reason="slow_client") \
        + srv.metrics.count("tristream_sessions_closed_total", reason="send_timeout") > 0
    stop.set()
    await w
    bad.transport.abort()
    return {**peak, "closed_as_slow": closed_by_server,
            "limits": {"max_outbox_events": srv.limits.max_outbox_events,
                       "write_buffer_bytes": srv.limits.write_buffer_bytes}}


def b64(n: int) -> str:
    """`n` zero bytes, base64."""
    return base64.b64encode(bytes(n)).decode()
