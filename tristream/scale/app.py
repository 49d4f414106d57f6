"""The Ray Serve application: a WebSocket ingress speaking `docs/protocol.md`, engine replicas behind it.

Same URL, auth, events and error codes as `tristream serve`: the ingress (a Serve deployment
with a FastAPI app) authenticates, places the session on an engine replica through the
`ReplicaPool` and relays frames both ways; the replica runs the very `RealtimeSession` state
machine and backend that the single-process server runs. Extra routes: ``/metrics`` (every
replica's metrics with a ``replica`` label, plus the pool's), ``/healthz``, ``/readyz`` and
``/scale/placement`` (session → replica, JSON).

Ways to run it:

- ``tristream serve --ray ...`` → `run_ray_server` (the CLI calls it);
- ``serve run tristream/scale/serve_config.yaml`` or
  ``serve run tristream.scale.app:app_builder backend=echo replicas=2 token=s3cret``;
- Python: ``serve.run(build_app(ScaleConfig(...)), route_prefix="/")``.
"""

# No `from __future__ import annotations` here, on purpose: Ray Serve's class-based FastAPI
# view re-resolves route signatures, and a string annotation on a WebSocket parameter makes
# the route unmatched (HTTP 403 on upgrade, seen with Ray 2.60 / FastAPI 0.165).

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve

from tristream.scale.autoscale import AutoscaleConfig
from tristream.scale.pool import (
    DEAD_ERRORS,
    NoReplicaAvailable,
    ReplicaPool,
    ScaleConfig,
    replica_failed_event,
)
from tristream.scale.prom import merge
from tristream.scale.replica import ReplicaSpec
from tristream.serve import protocol as P
from tristream.serve.limits import ServerLimits
from tristream.serve.server import WEB_DIR

log = logging.getLogger("tristream.scale")
KEY_SUBPROTOCOL = "openai-insecure-api-key."
fastapi_app = FastAPI(title="tristream (Ray Serve)")
_STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
           "style.css": "text/css; charset=utf-8"}


@serve.ingress(fastapi_app)
class RealtimeIngress:
    """The ingress deployment; see the module docstring."""

    def __init__(self, config: ScaleConfig) -> None:
        self.config = config
        self.limits: ServerLimits = config.spec.limits
        self.pool = ReplicaPool(config)
        self.pool.start()
        self.counters: dict[tuple[str, str], float] = {}
        self._scaler: asyncio.Task[None] | None = None

    def _inc(self, name: str, label: str = "") -> None:
        self.counters[(name, label)] = self.counters.get((name, label), 0.0) + 1

    def _ensure_scaler(self) -> None:
        if self._scaler is None or self._scaler.done():
            self._scaler = asyncio.get_running_loop().create_task(self._scale_loop())

    async def _scale_loop(self) -> None:
        while True:
            try:
                await self.pool.autoscale_once()
            except Exception:  # the loop must survive a bad tick; the next one retries
                log.exception("autoscale tick failed")
            await asyncio.sleep(self.config.autoscale_interval_s)

    # ------------------------------------------------------------ HTTP side
    @fastapi_app.get("/healthz")
    async def healthz(self) -> Response:
        """200 while the ingress runs."""
        return PlainTextResponse("ok\n")

    @fastapi_app.get("/readyz")
    async def readyz(self) -> Response:
        """200 when some replica accepts sessions."""
        self._ensure_scaler()
        ready = any(r.accepting for r in await self.pool.reports())
        return PlainTextResponse("ready\n" if ready else "not ready\n", status_code=200 if ready else 503)

    @fastapi_app.get("/scale/placement")
    async def placement(self) -> Response:
        """Session → replica, the replicas' load reports and the autoscaler's target."""
        reports = await self.pool.reports()
        return JSONResponse({"placement": self.pool.placement(), "desired": self.pool.desired,
                             "failures": self.pool.failures,
                             "replicas": [{**r.to_dict(), "pressure": min(r.pressure, 1e9)} for r in reports]})

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        """Every replica's metrics with a ``replica`` label, plus the pool's own."""
        self._ensure_scaler()
        texts = await self.pool.metrics_texts()
        reps = self.pool.last_reports
        lines = ["# HELP tristream_scale_replicas engine replicas by state", "# TYPE tristream_scale_replicas gauge",
                 f'tristream_scale_replicas{{state="live"}} {len(self.pool.live())}',
                 f'tristream_scale_replicas{{state="desired"}} {self.pool.desired}',
                 "# HELP tristream_scale_replica_failures_total replicas that died",
                 "# TYPE tristream_scale_replica_failures_total counter",
                 f"tristream_scale_replica_failures_total {self.pool.failures}",
                 "# HELP tristream_scale_replica_pressure load signal (max of queue and P99 over target)",
                 "# TYPE tristream_scale_replica_pressure gauge"]
        lines += [f'tristream_scale_replica_pressure{{replica="{r.replica}"}} {min(r.pressure, 1e9):g}' for r in reps]
        lines += ["# HELP tristream_scale_sessions_routed_total sessions placed per replica",
                  "# TYPE tristream_scale_sessions_routed_total counter"]
        lines += [f'tristream_scale_sessions_routed_total{{replica="{r.id}"}} {r.routed}' for r in self.pool.live()]
        lines += ["# HELP tristream_connections_refused_total refused at the ingress",
                  "# TYPE tristream_connections_refused_total counter"]
        lines += [f'tristream_connections_refused_total{{reason="{lab}"}} {v:g}'
                  for (name, lab), v in sorted(self.counters.items()) if name == "refused"]
        body = merge(texts) + "\n".join(lines) + "\n"
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @fastapi_app.get("/")
    async def index(self) -> Response:
        """The browser page of `tristream serve` (mic + camera), same origin as the API."""
        return await self.static("index.html")

    @fastapi_app.get("/{name}")
    async def static(self, name: str) -> Response:
        """``/app.js``, ``/style.css`` of the browser page."""
        f = WEB_DIR / name
        if name not in _STATIC or not f.is_file():
            return PlainTextResponse(f"no route /{name}; the API is at /v1/realtime\n", status_code=404)
        return Response(f.read_bytes(), media_type=_STATIC[name], headers={"Cache-Control": "no-store"})

    # ------------------------------------------------------------ WebSocket
    def _offered_tokens(self, ws: WebSocket) -> tuple[list[str], str | None]:
        offered: list[str] = []
        auth = ws.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            offered.append(auth[7:].strip())
        sub: str | None = None
        for proto in ws.headers.getlist("sec-websocket-protocol"):
            for p in (x.strip() for x in proto.split(",")):
                if p.startswith(KEY_SUBPROTOCOL):
                    offered.append(p[len(KEY_SUBPROTOCOL):])
                elif sub is None and p:
                    sub = p
        return offered, sub

    async def _deny(self, ws: WebSocket, status: int, text: str, reason: str) -> None:
        self._inc("refused", reason)
        headers = {"WWW-Authenticate": 'Bearer realm="tristream"'} if status == 401 else {"Retry-After": "5"}
        try:
            await ws.send_denial_response(PlainTextResponse(text, status_code=status, headers=headers))
        except RuntimeError:  # the server lacks the denial extension: close before accept (HTTP 403)
            await ws.close(1008, text.strip()[:120])

    @fastapi_app.websocket("/v1/realtime")
    async def realtime(self, ws: WebSocket) -> None:
        """One Realtime API session, relayed to the replica that holds it."""
        try:
            await self._realtime(ws)
        except Exception:
            log.exception("realtime session failed")
            raise

    async def _realtime(self, ws: WebSocket) -> None:
        self._ensure_scaler()
        offered, sub = self._offered_tokens(ws)
        if self.config.require_auth and not any(
                hmac.compare_digest(o.encode(), t.encode()) for o in offered for t in self.config.tokens):
            await self._deny(ws, 401, "missing or invalid bearer token: send 'Authorization: Bearer <token>' or "
                             "subprotocol 'openai-insecure-api-key.<token>'\n", "auth")
            return
        try:
            ref, sid, first = await self.pool.open_session()
        except NoReplicaAvailable as exc:
            await self._deny(ws, 503, f"{exc}\n", "max_sessions")
            return
        await ws.accept(subprotocol=sub)
        reason = "client_closed"
        inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        try:
            for msg in first:
                await ws.send_text(msg)
            async with asyncio.timeout(self.limits.max_session_s):
                reason = await self._relay(ws, ref.handle, sid, inbox)
        except TimeoutError:
            reason = "session_expired"
            with contextlib.suppress(Exception):
                await ws.send_text(P.dumps(P.error_event(P.ProtocolError(
                    P.E_SESSION_EXPIRED, f"session reached its {self.limits.max_session_s:g} s limit; reconnect"))))
        except DEAD_ERRORS:
            reason = "replica_failed"
        finally:
            if reason == "replica_failed":
                self.pool.mark_dead(ref.id)
                with contextlib.suppress(Exception):
                    await ws.send_text(P.dumps(replica_failed_event(ref.id)))
            else:
                with contextlib.suppress(*DEAD_ERRORS):
                    await ref.handle.close_session.remote(sid, reason)
            self.pool.session_ended(sid)
            self._inc("closed", reason)
            code = {"client_closed": 1000, "replica_failed": 1011}.get(reason, 1008)
            with contextlib.suppress(Exception):
                await ws.close(code, reason)

    async def _relay(self, ws: WebSocket, handle: Any, sid: str, inbox: asyncio.Queue[str | bytes | None]) -> str:
        """Run reader, forwarder and poller until one ends; returns the close reason."""

        async def reader() -> str:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return "client_closed"
                data = msg.get("text")
                inbox.put_nowait(data if data is not None else (msg.get("bytes") or b""))

        async def forwarder() -> str:
            while True:  # one call in flight per session keeps the client's order
                batch = [await inbox.get()]
                while not inbox.empty():
                    batch.append(inbox.get_nowait())
                await handle.push.remote(sid, [m for m in batch if m is not None])

        async def poller() -> str:
            while True:
                events = await handle.poll.remote(sid, 1.0)
                if events is None:
                    return "slow_client"
                for e in events:
                    await ws.send_text(e)

        tasks = [asyncio.ensure_future(c) for c in (reader(), forwarder(), poller())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                exc = t.exception()
                if isinstance(exc, WebSocketDisconnect):
                    return "client_closed"
                if exc is not None:
                    raise exc
            return str(next(iter(done)).result())
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


IngressDeployment = serve.deployment(name="tristream_ingress", num_replicas=1,
                                     ray_actor_options={"num_cpus": 0.5},
                                     max_ongoing_requests=1000)(RealtimeIngress)


def build_app(config: ScaleConfig) -> Any:
    """The bound Serve application (pass to ``serve.run``)."""
    return IngressDeployment.bind(config)


def config_from_args(args: dict[str, Any]) -> ScaleConfig:
    """A `ScaleConfig` from ``serve run`` style string arguments (see `serve_config.yaml`)."""
    def num(key: str, default: float) -> float:
        return float(args.get(key, default))

    replicas = int(num("replicas", 2))
    lo = int(num("min_replicas", replicas))
    hi = int(num("max_replicas", max(replicas, lo)))
    tokens = [t for t in str(args.get("token", "")).split(",") if t]
    backend_kw = json.loads(str(args["backend_kw"])) if "backend_kw" in args else {}
    spec = ReplicaSpec(backend=str(args.get("backend", "echo")), backend_kw=backend_kw,
                       limits=ServerLimits(max_sessions=int(num("max_sessions", 64))),
                       target_p99_ms=num("target_p99_ms", 50.0), target_queue_depth=num("target_queue_depth", 8.0))
    return ScaleConfig(spec=spec, autoscale=AutoscaleConfig(
        lo, hi, upscale_delay_s=num("upscale_delay_s", 5.0), downscale_delay_s=num("downscale_delay_s", 60.0)),
        replica_cpus=num("replica_cpus", 1.0), replica_gpus=num("replica_gpus", 0.0),
        name_prefix=str(args.get("name_prefix", "tristream")), max_sessions_per_replica=int(num("max_sessions", 64)),
        tokens=tokens, require_auth=str(args.get("no_auth", "false")).lower() not in ("1", "true", "yes"))


def app_builder(args: dict[str, Any]) -> Any:
    """Entry point for ``serve run tristream.scale.app:app_builder key=value ...`` and the YAML config."""
    cfg = config_from_args(args)
    if cfg.require_auth and not cfg.tokens:
        raise ValueError("auth is required but no token was given: pass token=<secret> (or no_auth=true "
                         "for a trusted local demo)")
    return build_app(cfg)


def run_ray_server(config: ScaleConfig, host: str = "127.0.0.1", port: int = 8765, address: str | None = None,
                   until: Any = None) -> None:
    """Start (or join, with ``address``) a Ray cluster, run the app on ``host:port`` and block.

    ``until``: an optional zero-argument callable polled every 0.5 s; return True to stop
    (the default runs until SIGINT/SIGTERM). Shuts Serve down on the way out.
    """
    import ray

    if config.require_auth and not config.tokens:
        raise ValueError("auth is required but no token was given: pass --token (or TRISTREAM_TOKEN), "
                         "or --no-auth for a trusted local demo")
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(config), name="tristream", route_prefix="/")
    log.info("tristream (Ray Serve) on ws://%s:%d/v1/realtime", host, port)
    try:
        while until is None or not until():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
