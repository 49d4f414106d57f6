"""`RealtimeServer`: the WebSocket server (``websockets``, asyncio) with HTTP side routes.

One port serves everything:

- ``GET /v1/realtime`` (any path ending in ``/realtime``): the Realtime API over WebSocket.
  Auth by ``Authorization: Bearer <token>`` or, for browsers that cannot set headers, the
  subprotocol ``openai-insecure-api-key.<token>`` (OpenAI's own browser convention).
- ``GET /`` and ``/app.js``, ``/style.css``: the browser page (``serve/web/``); ``GET /v1/info``
  (bearer token): the backend, its models and the WebRTC offer's port (`web_info.server_info`).
- ``GET /metrics``: Prometheus text; ``GET /healthz``: liveness; ``GET /readyz``: 503 while
  draining or full.

Isolation: each connection has its own reader, its own bounded outbox and writer task, so a
client that stops reading only fills its own outbox (then it is closed as a slow client);
limits are per session (`ServerLimits`). ``stop()`` drains: new connections get 503,
open sessions are told ``server_shutting_down``, answers in flight may finish within the
grace period, then sockets close with 1001.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.protocol import State

from tristream.observe.tracing import TurnTracer
from tristream.serve import protocol as P
from tristream.serve.backend import BackendFactory, Family, family_of
from tristream.serve.limits import ServerLimits
from tristream.serve.memtrim import MemoryTrimmer
from tristream.serve.metrics import ServeMetrics
from tristream.serve.session import RealtimeSession, TurnTiming

log = logging.getLogger("tristream.serve")
WEB_DIR = Path(__file__).resolve().parent / "web"
KEY_SUBPROTOCOL = "openai-insecure-api-key."
_STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
           "/index.html": ("index.html", "text/html; charset=utf-8"),
           "/app.js": ("app.js", "text/javascript; charset=utf-8"),
           "/style.css": ("style.css", "text/css; charset=utf-8")}


def break_handshake_cycle(ws: ServerConnection) -> None:
    """Cut websockets' cycle connection -> protocol.select_subprotocol (a closure) -> connection.

    websockets makes it for every connection because we pass ``select_subprotocol``, which only the
    handshake uses; the handler runs after it. Left in place, every closed connection (and what it
    references) waits for a full garbage collection: none comes while the server is idle, and a
    burst's worth makes that collection a long pause (docs/serve-memory.md)."""
    protocol = getattr(ws, "protocol", None)
    if protocol is not None and hasattr(protocol, "__dict__"):
        vars(protocol).pop("select_subprotocol", None)


class AuthError(Exception):
    """A connection without a valid token."""


@dataclasses.dataclass(slots=True)
class _Conn:
    session: RealtimeSession
    ws: ServerConnection
    outbox: asyncio.Queue[str | None]
    slow: bool = False


def http_response(conn: ServerConnection, status: int, body: str | bytes, ctype: str,
                  extra: dict[str, str] | None = None) -> Response:
    """A plain HTTP answer on the WebSocket server's port (metrics, health, the browser page):
    `body` with its type and length, never cached, plus `extra` headers."""
    resp = conn.respond(HTTPStatus(status), "")
    data = body.encode() if isinstance(body, str) else body
    headers = Headers([(k, v) for k, v in resp.headers.raw_items() if k.lower() not in
                       ("content-length", "content-type")])
    headers["Content-Type"] = ctype
    headers["Content-Length"] = str(len(data))
    headers["Cache-Control"] = "no-store"
    for k, v in (extra or {}).items():
        headers[k] = v
    return dataclasses.replace(resp, headers=headers, body=data)


class RealtimeServer:
    """The serving process: see the module docstring. Use ``async with`` or start()/stop()."""

    def __init__(
        self,
        backend_factory: BackendFactory,
        host: str = "127.0.0.1",
        port: int = 8765,
        tokens: list[str] | None = None,
        require_auth: bool = True,
        limits: ServerLimits | None = None,
        record_dir: Path | None = None,
        tracer: TurnTracer | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        token_tiers: dict[str, str] | None = None,
        chat_port: int | None = None,
        chat_required: bool = True,
        metrics_auth: bool = False,
    ) -> None:
        """``tokens`` may carry a tier as ``SECRET@bronze`` (the CLI's way); ``token_tiers`` maps
        tokens to the best SLA tier their sessions may use (default: any). ``chat_port``: also
        serve ``/v1/chat/completions`` there (0: a free port; see ``chat_url``) when the backend
        family answers on our engine (`BackendFamily.chat_llm`); ``chat_required`` False: a taken port
        only logs a warning. ``metrics_auth``: ``/metrics`` wants a bearer token too (it names
        sessions and counts their traffic)."""
        tiers = dict(token_tiers or {})
        plain: list[str] = []
        for t in tokens or []:
            secret, sep, tier = t.rpartition("@")
            if sep and tier in P.TIER_NAMES and secret:
                tiers[secret] = tier
                plain.append(secret)
            else:
                plain.append(t)
        tokens = plain
        if require_auth and not tokens:
            raise AuthError("auth is required but no token was given: pass --token (or TRISTREAM_TOKEN), "
                            "or --no-auth for a trusted local demo")
        self.factory = family_of(backend_factory)
        self.host = host
        self.port = port
        self.tokens = [t.encode() for t in (tokens or [])]
        self.token_tiers = {k.encode(): v for k, v in tiers.items()}
        self.require_auth = require_auth
        self.metrics_auth = metrics_auth
        self.limits = limits or ServerLimits()
        self.record_dir = record_dir
        self.tracer = tracer or TurnTracer()
        self.clock_ns = clock_ns
        self.metrics = ServeMetrics()
        self.metrics.add_collector(self._collect)
        self.conns: dict[str, _Conn] = {}
        self.draining = False
        self._server: Server | None = None
        self.turns: deque[TurnTiming] = deque(maxlen=4096)  # the latest turns; bounded (a long-running server)
        self._bg: set[asyncio.Task[None]] = set()
        self.chat_port = chat_port
        self.chat_required = chat_required
        self.chat: Any = None  # the side HTTP port (ChatCompletionsServer) once started
        self.webrtc: Any = None  # its WebRtcCalls where aiortc is installed
        self.trimmer = MemoryTrimmer(self.limits.memory_trim_s, self.limits.memory_trim_min_sessions,
                                     collect=self.limits.memory_trim_collect)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind and listen (``port=0`` picks a free port; read ``self.port`` after)."""
        self._server = await serve(
            self._handle, self.host, self.port,
            process_request=self._process_request,
            select_subprotocol=self._select_subprotocol,
            max_size=self.limits.hard_message_bytes,
            max_queue=64,
            write_limit=self.limits.write_buffer_bytes,
            compression=None,
            ping_interval=20, ping_timeout=20,
            # accept queue sized to the session limit (asyncio's default is 100): a burst of
            # connects is queued for accept() instead of being reset by the kernel
            backlog=max(128, min(4096, self.limits.max_sessions)),
        )
        sock = next(iter(self._server.sockets))
        self.port = sock.getsockname()[1]
        if self.record_dir is not None:
            # Recordings hold users' voices and images: owner-only directory and files.
            self.record_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.record_dir, 0o700)
        log.info("tristream realtime server on ws://%s:%d/v1/realtime", self.host, self.port)
        llm = self.factory.chat_llm
        if self.chat_port is not None:
            from tristream.serve.chat_completions import ChatCompletionsServer

            routes = self._webrtc_routes()
            chat = ChatCompletionsServer(llm if getattr(llm, "engine", None) is not None else None, self._token_ok,
                                         self.host, self.chat_port, draining=lambda: self.draining,
                                         count=self.metrics.inc, routes=routes)
            try:
                await chat.start()
            except OSError as exc:
                if self.chat_required:
                    raise
                log.warning("no /v1/chat/completions: cannot listen on %s:%d (%s)", self.host, self.chat_port,
                            exc.strerror)
                return
            self.chat = chat
            log.info("side HTTP port on %s: %s", chat.url, ", ".join(p for _, p in self.side_routes()) or "nothing")

    def _webrtc_routes(self) -> dict[str, Any]:
        """``/v1/realtime/calls`` (and the beta ``/v1/realtime``) when aiortc is installed."""
        try:
            import aiortc  # noqa: F401
        except ImportError:
            log.info("no WebRTC: aiortc is not installed")
            return {}
        from tristream.serve.webrtc import WebRtcCalls

        self.webrtc = WebRtcCalls(self)

        async def offer(headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
            if self.draining:
                return 503, "text/plain", b"server is shutting down\n"
            ctype = headers.get("content-type", "").split(";")[0].strip()
            if ctype != "application/sdp":
                return 400, "application/json", json.dumps({"error": {
                    "type": "invalid_request_error", "code": "invalid_offer", "param": "Content-Type",
                    "message": f"Content-Type must be application/sdp, got {ctype or 'none'}"}}).encode()
            return await self.webrtc.offer(body.decode("utf-8", "replace"))

        return {"/v1/realtime/calls": offer, "/v1/realtime": offer}

    @property
    def chat_url(self) -> str | None:
        """The OpenAI API base of ``/v1/chat/completions`` (None when not served)."""
        return None if self.chat is None else str(self.chat.url)

    def side_routes(self) -> list[tuple[str, str]]:
        """(name, path under `chat_url`) of what the side port serves: chat completions, WebRTC calls."""
        if self.chat is None:
            return []
        out = [("chat", "/chat/completions")] if self.chat.caller is not None else []
        return out + ([("webrtc", "/realtime/calls")] if self.webrtc is not None else [])

    def _token_ok(self, offered: str | None) -> bool:
        if not self.require_auth:
            return True
        return offered is not None and any(hmac.compare_digest(offered.encode(), t) for t in self.tokens)

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful shutdown: refuse new sessions, let answers finish, then close everyone."""
        if self._server is None:
            return
        self.draining = True
        grace = self.limits.shutdown_grace_s if grace_s is None else grace_s
        for c in list(self.conns.values()):
            if c.ws.state is not State.OPEN:
                continue
            c.session.send(P.server_event("error", error={
                "type": "server_error", "code": P.E_SHUTTING_DOWN, "param": None, "event_id": None,
                "message": f"server is shutting down; the session closes within {grace:g} s"}))
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(c.session.responding for c in self.conns.values()):
            await asyncio.sleep(0.02)
        if self.webrtc is not None:
            await self.webrtc.close_all()
        if self.chat is not None:
            await self.chat.close()
            self.chat = None
        self._server.close(close_connections=True, code=1001, reason="server shutting down")
        await self._server.wait_closed()
        self._server = None
        self.trimmer.cancel()

    async def __aenter__(self) -> RealtimeServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(grace_s=0.0)

    async def serve_forever(self) -> None:
        """Run until cancelled (the CLI cancels on SIGINT/SIGTERM and then calls stop())."""
        assert self._server is not None
        await self._server.serve_forever()

    # ------------------------------------------------------------ HTTP side
    def _authorized(self, request: Request) -> bool:
        if not self.require_auth:
            return True
        return self._token_of(request) is not None

    def _token_of(self, request: Request) -> bytes | None:
        """The configured token this request presents (None: none valid)."""
        offered: list[str] = []
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            offered.append(auth[7:].strip())
        for proto in request.headers.get_all("Sec-WebSocket-Protocol"):
            offered += [p.strip()[len(KEY_SUBPROTOCOL):] for p in proto.split(",")
                        if p.strip().startswith(KEY_SUBPROTOCOL)]
        for o in offered:
            for t in self.tokens:
                if hmac.compare_digest(o.encode(), t):
                    return t
        return None

    def _respond(self, conn: ServerConnection, status: int, body: bytes | str, ctype: str) -> Response:
        return http_response(conn, status, body, ctype)

    def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path.rstrip("/").endswith("/realtime"):
            if self.draining:
                self.metrics.inc("tristream_connections_refused_total", reason="draining")
                return self._respond(conn, 503, "server is shutting down\n", "text/plain")
            if not self._authorized(request):
                self.metrics.inc("tristream_connections_refused_total", reason="auth")
                resp = self._respond(conn, 401, "missing or invalid bearer token: send 'Authorization: Bearer "
                                     "<token>' or subprotocol 'openai-insecure-api-key.<token>'\n", "text/plain")
                resp.headers["WWW-Authenticate"] = 'Bearer realm="tristream"'
                return resp
            if len(self.conns) >= self.limits.max_sessions:
                self.metrics.inc("tristream_connections_refused_total", reason="max_sessions")
                resp = self._respond(conn, 503, f"server full: {self.limits.max_sessions} sessions\n", "text/plain")
                resp.headers["Retry-After"] = "5"
                return resp
            return None
        if path == "/metrics":
            if self.metrics_auth and not self._authorized(request):
                self.metrics.inc("tristream_connections_refused_total", reason="auth")
                return self._respond(conn, 401, "missing or invalid bearer token (the server runs with "
                                     "--metrics-auth)\n", "text/plain")
            return self._respond(conn, 200, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        if path == "/healthz":
            return self._respond(conn, 200, "ok\n", "text/plain")
        if path == "/readyz":
            ready = not self.draining and len(self.conns) < self.limits.max_sessions and self.backend_healthy()
            return self._respond(conn, 200 if ready else 503, "ready\n" if ready else "not ready\n", "text/plain")
        if path == "/v1/info":  # what the browser page shows: backend, models, where WebRTC offers go
            if not self._authorized(request):
                return self._respond(conn, 401, "missing or invalid bearer token\n", "text/plain")
            from tristream.serve.web_info import server_info

            return self._respond(conn, 200, json.dumps(server_info(self)), "application/json")
        if path in _STATIC:
            name, ctype = _STATIC[path]
            f = WEB_DIR / name
            if f.is_file():
                return self._respond(conn, 200, f.read_bytes(), ctype)
        return self._respond(conn, 404, f"no route {path}; the API is at /v1/realtime\n", "text/plain")

    def backend_healthy(self) -> bool:
        """The backend family's own health (`BackendFamily.healthy`)."""
        return bool(self.factory.healthy())

    def _select_subprotocol(self, conn: ServerConnection, subprotocols: Any) -> Any:
        for sp in subprotocols:
            if not sp.startswith(KEY_SUBPROTOCOL):
                return sp
        return subprotocols[0] if subprotocols else None

    def _collect(self) -> list[Family]:
        depth = [("tristream_session_outbox_depth", {"session": sid}, float(c.outbox.qsize()))
                 for sid, c in self.conns.items()]
        totals: dict[str, float] = {}
        for c in self.conns.values():
            counters = getattr(c.session.backend, "counters", None)
            for k, v in (counters() if counters else {}).items():
                totals[k] = totals.get(k, 0.0) + v
        fams: list[Family] = [
            ("tristream_sessions_active", "gauge", "open realtime sessions",
             [("tristream_sessions_active", {}, float(len(self.conns)))]),
            ("tristream_draining", "gauge", "1 while shutting down",
             [("tristream_draining", {}, 1.0 if self.draining else 0.0)]),
            ("tristream_session_outbox_depth", "gauge", "server events queued for a client", depth),
            ("tristream_backend_counter", "gauge", "backend counters summed over open sessions (drops by reason)",
             [("tristream_backend_counter", {"name": k}, v) for k, v in sorted(totals.items())]),
            *self.trimmer.families(),
        ]
        for c in self.conns.values():
            gauges = getattr(c.session.backend, "gauges", None)
            if gauges is not None:
                fams.extend(gauges())
        fams.extend(self.factory.collect())  # process-wide totals of the backend family
        return fams

    # ------------------------------------------------------------ sessions
    def _sender(self, holder: list[_Conn]) -> Callable[[dict[str, Any]], None]:
        def send(event: dict[str, Any]) -> None:
            if not holder:
                return
            c = holder[0]
            if c.slow:
                self.metrics.inc("tristream_events_dropped_total", reason="slow_client")
                return
            if c.outbox.qsize() >= self.limits.max_outbox_events:
                c.slow = True
                self.metrics.inc("tristream_events_dropped_total", reason="slow_client")
                self.metrics.inc("tristream_sessions_closed_total", reason="slow_client")
                task = asyncio.get_running_loop().create_task(
                    c.ws.close(1008, f"{P.E_SLOW_CLIENT}: {self.limits.max_outbox_events} events unread"))
                self._bg.add(task)  # the loop keeps only weak references to tasks
                task.add_done_callback(self._bg.discard)
                return
            c.outbox.put_nowait(P.dumps(event))
        return send

    async def _writer(self, c: _Conn) -> None:
        # Drain everything queued in one go: a send that does not hit the write limit
        # completes without suspending, so a burst of events leaves in one loop step
        # (asyncio.wait_for per message would cost a task and a loop hop each).
        outbox = c.outbox
        while True:
            batch = [await outbox.get()]
            while not outbox.empty():
                batch.append(outbox.get_nowait())
            try:
                async with asyncio.timeout(self.limits.send_timeout_s):
                    for msg in batch:
                        if msg is None:
                            return
                        await c.ws.send(msg)
            except TimeoutError:
                c.slow = True
                self.metrics.inc("tristream_sessions_closed_total", reason="send_timeout")
                await c.ws.close(1008, f"{P.E_SLOW_CLIENT}: a send blocked for {self.limits.send_timeout_s:g} s")
                return
            except ConnectionClosed:
                return

    async def _handle(self, ws: ServerConnection) -> None:
        break_handshake_cycle(ws)
        if len(self.conns) >= self.limits.max_sessions or self.draining:
            await ws.close(1013, "server full or draining; try again later")
            return
        sid = P.new_id("sess")
        recorder = None
        if self.record_dir is not None:
            path = self.record_dir / f"{sid}.mcap"
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))  # owner-only before any byte
            from tristream.observe.record import McapRecorder  # mcap only where recording is on

            recorder = McapRecorder(path, sid)
        holder: list[_Conn] = []
        token = self._token_of(ws.request) if self.require_auth and ws.request is not None else None
        session = RealtimeSession(sid, self.factory(), self._sender(holder), self.clock_ns, self.limits,
                                  self.metrics, tap=recorder.tap if recorder else None,
                                  on_turn=lambda t: self._on_turn(sid, t),
                                  tier_cap=self.token_tiers.get(token) if token is not None else None)
        c = _Conn(session, ws, asyncio.Queue())
        holder.append(c)
        self.conns[sid] = c
        self.trimmer.opened(len(self.conns))
        self.metrics.inc("tristream_sessions_total")
        writer = asyncio.get_running_loop().create_task(self._writer(c))
        reason = "client_closed"
        try:
            if recorder is not None:
                recorder.write_meta({"session_id": sid, "settings": session.settings.to_json(),
                                     "limits": dataclasses.asdict(self.limits)}, self.clock_ns())
            await session.open()
            deadline = asyncio.get_running_loop().time() + self.limits.max_session_s
            try:
                async with asyncio.timeout_at(deadline):
                    async for raw in ws:
                        session.handle_message(raw)
            except TimeoutError:
                reason = "session_expired"
                session.send_error(P.ProtocolError(P.E_SESSION_EXPIRED, f"session reached its "
                                                   f"{self.limits.max_session_s:g} s limit; reconnect"))
            except ConnectionClosed:
                pass
        except Exception:
            reason = "server_error"
            log.exception("session %s failed", sid)
        finally:
            try:
                self.metrics.inc("tristream_sessions_closed_total", reason=reason)
                try:
                    await session.close()
                except Exception:  # the client still gets its close frame, the table its slot back
                    log.exception("session %s: backend failed to close", sid)
                c.outbox.put_nowait(None)
                with contextlib.suppress(TimeoutError, ConnectionClosed):
                    await asyncio.wait_for(writer, 2.0)
                writer.cancel()
                await ws.close(1000 if reason == "client_closed" else 1008, reason)
            finally:
                # Whatever failed or was cancelled above, the session leaves the table (else it
                # counts against max_sessions forever), and the send closure lets go of it: that
                # cuts the cycle session -> send -> holder -> _Conn -> session, so the session, its
                # backend and outbox are freed now by reference counting, not left to a full
                # garbage collection (see break_handshake_cycle).
                self.conns.pop(sid, None)
                holder.clear()
                self.trimmer.closed(len(self.conns), asyncio.get_running_loop())
                if recorder is not None:
                    recorder.close()

    def _on_turn(self, sid: str, t: TurnTiming) -> None:
        self.turns.append(t)
        self.tracer.record_turn(sid, t)
