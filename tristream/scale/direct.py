"""`DirectIngress`: the Ray app's WebSocket ingress without Serve's HTTP proxy in the path.

Each ingress replica (a Serve deployment replica, as many as ``ScaleConfig.n_ingress()``)
runs its own ``websockets`` server on ``host:port`` with SO_REUSEPORT, so the kernel spreads
connections over the ingress processes and their CPU scales with their number. Same URL, auth,
limits, routes and error codes as ``tristream serve`` (`tristream.serve.server`): the
handshake is checked in ``process_request`` (401 without a valid token, 503 when no replica
can take the session: the session is placed on a replica by the `PoolRouter` before the
upgrade is accepted), then `run_session` relays frames straight to the engine replica's
actor, batched per replica (`tristream.scale.relay`). Routes: ``/v1/realtime`` (any path
ending in ``/realtime``), ``/metrics``, ``/healthz``, ``/readyz``, ``/scale/placement``, ``/``
and the page's ``/app.js``, ``/style.css``.

Why: through the proxy every frame crossed two extra hops (proxy → ingress over Serve's
ASGI bridge, and back), about 10 ms of proxy CPU and 13–15 ms of ingress CPU per answered
turn (``bench/results/scale_profile_cpu_head.json`` at 4c4c48b), all in one process of each.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from tristream.scale.pool import ScaleConfig
from tristream.scale.relay import Relay, SessionPipe
from tristream.scale.router import Opened, Refused
from tristream.scale.session_relay import SocketOps, run_session
from tristream.serve import protocol as P
from tristream.serve.server import _STATIC, KEY_SUBPROTOCOL, WEB_DIR, break_handshake_cycle, http_response

log = logging.getLogger("tristream.scale")
AUTH_HELP = ("missing or invalid bearer token: send 'Authorization: Bearer <token>' or subprotocol "
             "'openai-insecure-api-key.<token>'\n")


def offered_tokens(auth_header: str, subprotocol_headers: list[str]) -> list[str]:
    """Tokens a handshake presents: ``Authorization: Bearer <t>`` and ``openai-insecure-api-key.<t>``."""
    offered: list[str] = []
    if auth_header.lower().startswith("bearer "):
        offered.append(auth_header[7:].strip())
    for proto in subprotocol_headers:
        offered += [p.strip()[len(KEY_SUBPROTOCOL):] for p in proto.split(",")
                    if p.strip().startswith(KEY_SUBPROTOCOL)]
    return offered


def token_ok(offered: list[str], tokens: list[str]) -> bool:
    """Constant-time match of any offered token against the configured ones."""
    return any(hmac.compare_digest(o.encode(), t.encode()) for o in offered for t in tokens)


def _respond(conn: ServerConnection, status: int, body: str | bytes, ctype: str,
             extra: dict[str, str] | None = None) -> Response:
    return http_response(conn, status, body, ctype, extra)


class DirectIngress:
    """See the module docstring. Bound by `tristream.scale.app.build_app` with the router's handle."""

    async def __init__(self, config: ScaleConfig, router: Any) -> None:  # type: ignore[misc]  # Ray allows it
        self.config = config
        self.limits = config.spec.limits
        self.router = router
        self.relay = Relay(self.limits.max_outbox_events, config.spec.poll_wait_s, count=self._count,
                           mode=config.relay)
        self._placed: dict[Any, tuple[str, SessionPipe, Opened]] = {}
        self._reapers: set[asyncio.Task[None]] = set()
        self._server: Server = await serve(
            self._handle, config.host, config.port, reuse_port=True,
            process_request=self._process_request, select_subprotocol=self._select_subprotocol,
            max_size=self.limits.hard_message_bytes, max_queue=64, write_limit=self.limits.write_buffer_bytes,
            compression=None, ping_interval=20, ping_timeout=20,
            backlog=max(128, min(4096, config.max_sessions_per_replica * config.autoscale.max_replicas)))
        self.port = next(iter(self._server.sockets)).getsockname()[1]
        log.info("tristream direct ingress %s on ws://%s:%d/v1/realtime", self.relay.ingress_id, config.host,
                 self.port)

    async def __call__(self, request: Any) -> Any:
        """Through Serve's proxy (if one runs) this ingress only says where it listens."""
        from starlette.responses import PlainTextResponse

        return PlainTextResponse(f"the realtime API listens on ws://{self.config.host}:{self.port}/v1/realtime\n",
                                 status_code=404)

    async def __del__(self) -> None:
        """Serve's graceful shutdown: stop listening (another deployment may take the port)."""
        self._server.close(close_connections=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 5.0)
        await self.relay.close()

    def _count(self, name: str, label: str) -> Any:
        return self.router.count.remote(name, label)

    # ------------------------------------------------------------ handshake and HTTP routes
    def _select_subprotocol(self, conn: ServerConnection, subprotocols: Any) -> Any:
        for sp in subprotocols:
            if not sp.startswith(KEY_SUBPROTOCOL):
                return sp
        return subprotocols[0] if subprotocols else None

    async def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path.rstrip("/").endswith("/realtime"):
            return await self._open(conn, request)
        if path == "/metrics":
            text = await self.router.metrics_text.remote()
            return _respond(conn, 200, text, "text/plain; version=0.0.4; charset=utf-8")
        if path == "/healthz":
            return _respond(conn, 200, "ok\n", "text/plain")
        if path == "/readyz":
            ready = await self.router.ready.remote()
            return _respond(conn, 200 if ready else 503, "ready\n" if ready else "not ready\n", "text/plain")
        if path == "/scale/placement":
            return _respond(conn, 200, json.dumps(await self.router.placement.remote()), "application/json")
        if path in _STATIC:
            name, ctype = _STATIC[path]
            f = WEB_DIR / name
            if f.is_file():
                return _respond(conn, 200, f.read_bytes(), ctype)
        return _respond(conn, 404, f"no route {path}; the API is at /v1/realtime\n", "text/plain")

    async def _open(self, conn: ServerConnection, request: Request) -> Response | None:
        """Auth, then place the session before the upgrade (so a full fleet answers HTTP 503)."""
        if self.config.require_auth and not token_ok(
                offered_tokens(request.headers.get("Authorization", ""),
                               request.headers.get_all("Sec-WebSocket-Protocol")), self.config.tokens):
            await self.router.count.remote("refused", "auth")
            return _respond(conn, 401, AUTH_HELP, "text/plain", {"WWW-Authenticate": 'Bearer realm="tristream"'})
        sid = P.new_id("sess")
        pipe = self.relay.expect(sid)
        res = await self.router.open_session.remote(self.relay.ingress_id, sid)
        if isinstance(res, Refused):
            self.relay.forget(sid)
            await self.router.count.remote("refused", "max_sessions")
            return _respond(conn, 503, f"{res.message}\n", "text/plain", {"Retry-After": "5"})
        self._placed[conn] = (sid, pipe, res)
        task = asyncio.get_running_loop().create_task(self._reap(conn))
        self._reapers.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._reapers.discard)
        return None

    async def _reap(self, conn: ServerConnection) -> None:
        """A session placed for a handshake that then failed (the handler never ran): free it."""
        await conn.wait_closed()
        placed = self._placed.pop(conn, None)
        if placed is None:
            return
        sid, _, opened = placed
        self.relay.forget(sid)
        with contextlib.suppress(Exception):
            await opened.handle.close_session.remote(sid, "handshake_failed")
        with contextlib.suppress(Exception):
            await self.router.session_ended.remote(sid)

    # ------------------------------------------------------------ sessions
    async def _handle(self, ws: ServerConnection) -> None:
        break_handshake_cycle(ws)  # as tristream serve: closed connections freed without a full GC
        placed = self._placed.pop(ws, None)
        if placed is None:  # cannot happen: every upgrade went through _open
            await ws.close(1011, "session was not placed")
            return
        sid, pipe, opened = placed

        async def recv() -> str | bytes | None:
            try:
                return await ws.recv()
            except ConnectionClosed:
                return None

        await run_session(self.relay, self.router, sid, pipe, opened, SocketOps(recv, ws.send, ws.close),
                          self.limits)
