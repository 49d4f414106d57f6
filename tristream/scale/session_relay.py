"""`run_session`: one client session relayed between its socket and its engine replica.

Shared by both ingress kinds (the direct ``websockets`` listener and the Serve-proxy FastAPI
view): they differ only in how a socket is read, written and closed (`SocketOps`). A reader
task moves client messages to the replica link (batched per replica, `tristream.scale.relay`),
a writer task moves the session's outbox to the socket; the first to end decides the close
reason. Close codes as in ``tristream serve``: 1000 client closed, 1011 replica failed, 1008
otherwise (session expired, slow client).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tristream.scale.pool import DEAD_ERRORS, replica_failed_event
from tristream.scale.relay import REPLICA_FAILED, SLOW_CLIENT, End, Relay, ReplicaLink, SessionPipe
from tristream.scale.router import Opened
from tristream.serve import protocol as P
from tristream.serve.limits import ServerLimits

log = logging.getLogger("tristream.scale")
CLOSE_CODES = {"client_closed": 1000, REPLICA_FAILED: 1011}


@dataclass(slots=True)
class SocketOps:
    """How to use one client socket."""

    recv: Callable[[], Awaitable[str | bytes | None]]
    """Next client message; None once the client has closed."""
    send: Callable[[str], Awaitable[None]]
    """Send one text frame (raises when the socket is closed)."""
    close: Callable[[int, str], Awaitable[None]]


async def _reader(link: ReplicaLink, sid: str, ops: SocketOps) -> str:
    recv, push = ops.recv, link.push
    while True:
        msg = await recv()
        if msg is None:
            return "client_closed"
        push(sid, msg)


async def _writer(pipe: SessionPipe, ops: SocketOps, send_timeout_s: float) -> str:
    # Drain everything queued in one go (like tristream.serve's writer): a burst of events
    # leaves in one loop step without a timeout object per frame.
    outbox, send = pipe.outbox, ops.send
    while True:
        batch = [await outbox.get()]
        while not outbox.empty():
            batch.append(outbox.get_nowait())
        try:
            async with asyncio.timeout(send_timeout_s):
                for m in batch:
                    if isinstance(m, End):
                        return m.reason
                    await send(m)
        except TimeoutError:
            return SLOW_CLIENT
        except Exception:  # the socket closed under us (each library raises its own kind)
            return "client_closed"


async def run_session(relay: Relay, router: Any, sid: str, pipe: SessionPipe, opened: Opened, ops: SocketOps,
                      limits: ServerLimits) -> str:
    """Relay one placed session until it ends; free it everywhere; close the socket. Returns the reason."""
    link = relay.attach(sid, opened.replica, opened.handle)
    reason = "client_closed"
    tasks: list[asyncio.Task[str]] = []
    try:
        for m in opened.first:
            await ops.send(m)
        async with asyncio.timeout(limits.max_session_s):
            tasks = [asyncio.ensure_future(_reader(link, sid, ops)),
                     asyncio.ensure_future(_writer(pipe, ops, limits.send_timeout_s))]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            reason = next(iter(done)).result()
    except TimeoutError:
        reason = "session_expired"
        with contextlib.suppress(Exception):
            await ops.send(P.dumps(P.error_event(P.ProtocolError(
                P.E_SESSION_EXPIRED, f"session reached its {limits.max_session_s:g} s limit; reconnect"))))
    except Exception:
        reason = "server_error"
        log.exception("session %s failed in the relay", sid)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        relay.forget(sid, link)
        if reason == REPLICA_FAILED or link.dead:
            reason = REPLICA_FAILED
            with contextlib.suppress(Exception):
                await router.replica_failed.remote(opened.replica)
            with contextlib.suppress(Exception):
                await ops.send(P.dumps(replica_failed_event(opened.replica)))
        else:
            with contextlib.suppress(*DEAD_ERRORS):
                await opened.handle.close_session.remote(sid, reason)
        with contextlib.suppress(Exception):
            await router.session_ended.remote(sid)
        with contextlib.suppress(Exception):
            await ops.close(CLOSE_CODES.get(reason, 1008), reason)
    return reason
