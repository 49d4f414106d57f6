"""`Relay`: one ingress process's frame path to the engine replicas, batched per replica.

Per engine replica this ingress talks to there is one `ReplicaLink`. By default
(``mode="socket"``) it is one TCP stream to the replica (`tristream.scale.wire`): client
messages go out as framed records, every record of one event-loop step in one write, and
the replica's events come back the same way; Ray actor calls carry only session opens and
closes. With ``mode="ray"`` the frames go by Ray actor calls, batched, with two loops:

- **push**: client messages of every session on that replica accumulate in one dict while a
  ``push_many`` call is in flight; the next call carries all of them. One call in flight per
  link keeps every session's order.
- **poll**: one ``poll_many`` long-poll in flight per link returns the queued events of every
  session of this ingress on that replica; they are put on each session's outbox (`SessionPipe`),
  which that session's own writer sends to its socket, so a slow client fills only its own
  outbox (bounded: past ``max_outbox_events`` it is closed as a slow client, counted).

Why: per frame the relay's cost was one Ray call on each side (≈ 0.3–0.6 ms of CPU, profiled by
``bench/scale_profile.py``); with one call per link in flight, frames that arrive while a call
is out share the next one, so under load the calls per frame fall below one. The events are
the replica's JSON text, sent on unchanged (never decoded or re-encoded here).

If a call fails because the replica died, every session of this link gets a ``replica_failed``
end on its outbox and the link is dropped (a new link is made if the replica id comes back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from tristream.scale.pool import DEAD_ERRORS
from tristream.scale.wire import BINARY, EVENT, HELLO, TEXT, Outlet, RecordProtocol, record

log = logging.getLogger("tristream.scale")
REPLICA_FAILED = "replica_failed"
SLOW_CLIENT = "slow_client"


@dataclass(slots=True, frozen=True)
class End:
    """Put on a session's outbox: the session must close for ``reason``."""

    reason: str


@dataclass(slots=True)
class SessionPipe:
    """One session's outbox (server events in order, then possibly an `End`)."""

    sid: str
    outbox: asyncio.Queue[str | End] = field(default_factory=asyncio.Queue)
    ended: bool = False

    def end(self, reason: str) -> None:
        """Tell the session's writer to stop (once)."""
        if not self.ended:
            self.ended = True
            self.outbox.put_nowait(End(reason))


class ReplicaLink:
    """This ingress's frame path to one engine replica: a relay stream, or batched Ray calls."""

    def __init__(self, relay: Relay, replica: str, handle: Any) -> None:
        self.relay = relay
        self.replica = replica
        self.handle = handle
        self.sids: set[str] = set()
        self.dead = False
        self._pending: dict[str, list[str | bytes]] = {}
        self._pusher: asyncio.Task[None] | None = None
        self._outlet: Outlet | None = None
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._poll_loop() if relay.mode == "ray" else self._connect())

    async def _connect(self) -> None:
        """Socket mode: fetch the replica's endpoint through Ray, connect, say hello, flush what waited."""
        try:
            ep = await self.handle.relay_endpoint.remote()
            transport, _ = await asyncio.get_running_loop().create_connection(
                lambda: RecordProtocol(self._on_record, self._on_lost), ep.host, ep.port)
        except DEAD_ERRORS:
            self.fail()
            return
        except OSError:
            log.exception("relay connection to replica %s failed; its sessions here are closed", self.replica)
            self.fail()
            return
        if self.dead:
            transport.close()
            return
        transport.write(record(HELLO, self.relay.ingress_id, ep.secret))
        self._outlet = Outlet(cast(asyncio.Transport, transport), 256 << 20,
                              lambda reason: self.relay.count("relay_dropped", reason))
        pending, self._pending = self._pending, {}
        for sid, msgs in pending.items():
            for m in msgs:
                self._send(sid, m)

    def _send(self, sid: str, message: str | bytes) -> None:
        assert self._outlet is not None
        if isinstance(message, str):
            self._outlet.send(TEXT, sid, message.encode())
        else:
            self._outlet.send(BINARY, sid, message)

    def _on_record(self, kind: bytes, sid: str, payload: bytes) -> None:
        if kind == EVENT:
            self.relay.deliver_one(sid, payload.decode())
        else:
            self.relay.count("relay_dropped", "bad_record")

    def _on_lost(self, exc: Exception | None) -> None:
        if not self.dead:  # the replica's process is gone (or its socket broke): its sessions are lost
            log.warning("relay connection to replica %s lost (%s)", self.replica, exc)
            self.fail()

    def push(self, sid: str, message: str | bytes) -> None:
        """Queue one client message of ``sid`` for the replica (sent with the next batch)."""
        if self.dead:
            self.relay.count("relay_dropped", REPLICA_FAILED)
            return
        if self._outlet is not None:
            self._send(sid, message)
            return
        batch = self._pending.get(sid)
        if batch is None:
            self._pending[sid] = [message]
        else:
            batch.append(message)
        if self._pusher is None and self.relay.mode == "ray":
            self._pusher = asyncio.get_running_loop().create_task(self._push_loop())

    async def _push_loop(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, {}
                await self.handle.push_many.remote(batch)
        except DEAD_ERRORS:
            self.fail()
        except Exception:  # a bug or a transient Ray error: those messages are lost, say so
            log.exception("push to replica %s failed", self.replica)
            self.relay.count("relay_dropped", "push_failed")
        finally:
            self._pusher = None

    async def _poll_loop(self) -> None:
        deliver = self.relay.deliver
        try:
            while True:
                out = await self.handle.poll_many.remote(self.relay.ingress_id, self.relay.poll_wait_s)
                for sid, events in out.items():
                    deliver(sid, events)
        except DEAD_ERRORS:
            self.fail()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("poll of replica %s failed; its sessions here are closed", self.replica)
            self.fail()

    def fail(self) -> None:
        """The replica died: end every session of this link with ``replica_failed``."""
        if self.dead:
            return
        self.dead = True
        self.relay.links.pop(self.replica, None)
        for sid in list(self.sids):
            pipe = self.relay.pipes.get(sid)
            if pipe is not None:
                pipe.end(REPLICA_FAILED)
        self._task.cancel()
        if self._outlet is not None:
            self._outlet.transport.close()


class Relay:
    """Every session of one ingress process: pipes by session id, links by replica id."""

    def __init__(self, max_outbox_events: int, poll_wait_s: float = 1.0,
                 count: Callable[[str, str], Awaitable[None] | None] | None = None, mode: str = "socket") -> None:
        if mode not in ("socket", "ray"):
            raise ValueError(f"relay mode must be 'socket' or 'ray', not {mode!r}")
        self.mode = mode
        self.ingress_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.max_outbox_events = max_outbox_events
        self.poll_wait_s = poll_wait_s
        self.pipes: dict[str, SessionPipe] = {}
        self.links: dict[str, ReplicaLink] = {}
        self._count = count
        self._bg: set[asyncio.Task[None]] = set()

    def count(self, name: str, label: str) -> None:
        """Report a counted event (refused, dropped) to the router; never blocks the relay."""
        if self._count is None:
            return
        res = self._count(name, label)
        if res is not None:
            task = asyncio.ensure_future(res)
            self._bg.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._bg.discard)

    def expect(self, sid: str) -> SessionPipe:
        """Make the session's pipe before it is opened on a replica (its events may come early)."""
        pipe = self.pipes[sid] = SessionPipe(sid)
        return pipe

    def attach(self, sid: str, replica: str, handle: Any) -> ReplicaLink:
        """The session lives on ``replica``: its link (made on first use)."""
        link = self.links.get(replica)
        if link is None or link.dead:
            link = self.links[replica] = ReplicaLink(self, replica, handle)
        link.sids.add(sid)
        return link

    def forget(self, sid: str, link: ReplicaLink | None = None) -> None:
        """The session ended: later events for it are counted and dropped."""
        self.pipes.pop(sid, None)
        if link is not None:
            link.sids.discard(sid)

    def deliver(self, sid: str, events: list[str] | None) -> None:
        """Events from a replica for one session (None: the replica closed it as a slow client)."""
        pipe = self.pipes.get(sid)
        if pipe is None or pipe.ended:
            self.count("relay_dropped", "session_gone")
            return
        if events is None:
            pipe.end(SLOW_CLIENT)
            return
        if pipe.outbox.qsize() + len(events) > self.max_outbox_events:
            self.count("relay_dropped", SLOW_CLIENT)
            pipe.end(SLOW_CLIENT)
            return
        put = pipe.outbox.put_nowait
        for e in events:
            put(e)

    def deliver_one(self, sid: str, event: str) -> None:
        """One event from a replica's socket for one session."""
        pipe = self.pipes.get(sid)
        if pipe is None or pipe.ended:
            self.count("relay_dropped", "session_gone")
            return
        if pipe.outbox.qsize() >= self.max_outbox_events:
            self.count("relay_dropped", SLOW_CLIENT)
            pipe.end(SLOW_CLIENT)
            return
        pipe.outbox.put_nowait(event)

    async def close(self) -> None:
        """Stop every link's loops (the ingress is shutting down)."""
        for link in list(self.links.values()):
            link.dead = True
            link._task.cancel()
            with contextlib.suppress(BaseException):
                await link._task
            if link._outlet is not None:
                link._outlet.transport.close()
        self.links.clear()
