"""The relay's data plane: one TCP stream per (ingress process, engine replica), framed records.

Sessions are opened, placed and closed through Ray actor calls (the control plane); their
frames — client messages in, server events out — travel over a plain socket between the
ingress and the replica. Why not Ray calls for frames: a Ray call costs about 0.3–0.5 ms of CPU
on each side per call (``bench/scale_profile.py``; a streaming generator is not much cheaper
on the receiving side), and an answered turn is ~24 frames; a framed record on a socket costs
a few microseconds, and every record written in one event-loop step leaves in one ``write``.

Record: 4-byte big-endian length, then kind (1 byte), session-id length (1 byte), session id
(ASCII), payload. Kinds: ``H`` hello (ingress → replica, first record: payload = the replica's
secret, session id = the ingress id), ``T`` / ``B`` a client text / binary message, ``E`` a
server event (JSON text).

Security: the replica listens on its node's address with a random 32-byte secret that only
reaches an ingress through Ray (``relay_endpoint``); a connection whose first record is not
the right hello is closed (counted).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

log = logging.getLogger("tristream.scale")
HELLO, TEXT, BINARY, EVENT = b"H", b"T", b"B", b"E"
MAX_RECORD = 64 << 20
"""A larger length is a corrupt stream (client messages are capped far below, at the socket)."""
MAX_HELLO = 1024
"""Largest first record (the hello) a replica accepts: before the secret is checked, a stranger
cannot make it buffer more than this."""


class WireError(Exception):
    """A corrupt or unauthenticated relay stream: the connection is closed."""


def record(kind: bytes, sid: str, payload: bytes) -> bytes:
    """One framed record."""
    s = sid.encode("ascii")
    n = 2 + len(s) + len(payload)
    return n.to_bytes(4, "big") + kind + len(s).to_bytes(1, "big") + s + payload


@dataclass(slots=True)
class Endpoint:
    """Where a replica's relay listens, and the secret that opens it (crosses processes via Ray)."""

    host: str
    port: int
    secret: bytes


class RecordProtocol(asyncio.Protocol):
    """Splits a byte stream into records and hands each to ``on_record(kind, sid, payload)``."""

    def __init__(self, on_record: Callable[[bytes, str, bytes], None],
                 on_lost: Callable[[Exception | None], None] | None = None) -> None:
        self.on_record = on_record
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.max_record = MAX_RECORD
        """Largest record accepted now (a server lowers it to `MAX_HELLO` until the hello)."""
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, n = 0, len(buf)
        try:
            while n - pos >= 4:
                size = int.from_bytes(buf[pos:pos + 4], "big")
                if size < 2 or size > self.max_record:
                    raise WireError(f"relay record of {size} bytes: corrupt stream")
                if n - pos - 4 < size:
                    break
                start = pos + 4
                slen = buf[start + 1]
                sid = buf[start + 2:start + 2 + slen].decode("ascii")
                self.on_record(bytes(buf[start:start + 1]), sid, bytes(buf[start + 2 + slen:start + size]))
                pos = start + size
        except (WireError, UnicodeDecodeError) as exc:
            log.warning("relay stream closed: %s", exc)
            if self.transport is not None:
                self.transport.abort()
            return
        finally:
            del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.on_lost is not None:
            self.on_lost(exc)


class Outlet:
    """The replica's side of one ingress connection: records batched per event-loop step."""

    def __init__(self, transport: asyncio.Transport, max_buffer_bytes: int, on_drop: Callable[[str], None]) -> None:
        self.transport = transport
        self.max_buffer_bytes = max_buffer_bytes
        self.on_drop = on_drop
        self.records = 0
        self.writes = 0
        self._out: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def send(self, kind: bytes, sid: str, payload: bytes) -> None:
        """Queue one record; all records of this loop step are written together."""
        if self.transport.is_closing():
            self.on_drop("ingress_gone")
            return
        if self.transport.get_write_buffer_size() > self.max_buffer_bytes:
            # the ingress process stopped reading (hung or far overloaded): rather than leave holes
            # in its sessions' event streams, drop the link; its sessions end with an error on
            # both sides (the ingress: replica_failed, so clients reconnect; here: ingress_lost)
            self.on_drop("ingress_backlog")
            self.transport.abort()
            return
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(record(kind, sid, payload))

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self.transport.is_closing():
            self.records += len(out)
            self.writes += 1
            self.transport.write(b"".join(out))


class WireServer:
    """A replica's relay listener: authenticates ingress connections, routes their records.

    ``on_message(ingress, sid, data)`` gets each client message; ``on_connect(ingress)`` runs
    once an ingress has said hello (to flush events queued for it before), ``on_disconnect``
    when its stream closes; ``outlets`` maps an ingress id to its `Outlet` while connected.
    """

    def __init__(self, on_message: Callable[[str, str, str | bytes], None], on_count: Callable[[str, str], None],
                 on_connect: Callable[[str], None], on_disconnect: Callable[[str], None] | None = None,
                 max_buffer_bytes: int = 256 << 20) -> None:
        self.on_message = on_message
        self.on_count = on_count
        self.on_connect = on_connect
        self.on_disconnect = on_disconnect
        self.max_buffer_bytes = max_buffer_bytes
        self.secret = secrets.token_bytes(32)
        self.outlets: dict[str, Outlet] = {}
        self.endpoint: Endpoint | None = None
        self._done = [0, 0]  # records and writes of outlets that have closed
        self._server: asyncio.Server | None = None

    async def start(self, host: str) -> Endpoint:
        """Listen on ``host`` (this node's address), port chosen by the kernel (once)."""
        if self.endpoint is None:
            self._server = await asyncio.get_running_loop().create_server(self._protocol, host, 0)
            port = self._server.sockets[0].getsockname()[1]
            self.endpoint = Endpoint(host, port, self.secret)
        return self.endpoint

    def _protocol(self) -> RecordProtocol:
        state: dict[str, str] = {}
        proto: RecordProtocol

        def on_record(kind: bytes, sid: str, payload: bytes) -> None:
            ingress = state.get("ingress")
            if ingress is None:
                if kind != HELLO or not hmac.compare_digest(payload, self.secret):
                    self.on_count("tristream_relay_refused_total", "bad_hello")
                    raise WireError("relay connection without the replica's secret")
                assert proto.transport is not None
                proto.max_record = MAX_RECORD
                state["ingress"] = sid
                self.outlets[sid] = Outlet(proto.transport, self.max_buffer_bytes,
                                           lambda reason: self.on_count("tristream_events_dropped_total", reason))
                self.on_connect(sid)
                return
            if kind == TEXT:
                self.on_message(ingress, sid, payload.decode("utf-8", "replace"))
            elif kind == BINARY:
                self.on_message(ingress, sid, payload)
            else:
                raise WireError(f"unexpected relay record {kind!r} from an ingress")

        def on_lost(exc: Exception | None) -> None:
            ingress = state.get("ingress")
            if ingress is not None and self.outlets.get(ingress) is not None \
                    and self.outlets[ingress].transport is proto.transport:
                gone = self.outlets.pop(ingress)
                self._done[0] += gone.records
                self._done[1] += gone.writes
                if self.on_disconnect is not None:
                    self.on_disconnect(ingress)

        proto = RecordProtocol(on_record, on_lost)
        proto.max_record = MAX_HELLO
        return proto

    def totals(self) -> tuple[int, int]:
        """(event records sent, socket writes) so far: records per write is the batching achieved."""
        outlets = list(self.outlets.values())
        return self._done[0] + sum(o.records for o in outlets), self._done[1] + sum(o.writes for o in outlets)

    def close(self) -> None:
        """Stop listening (connections close with the process)."""
        if self._server is not None:
            self._server.close()
