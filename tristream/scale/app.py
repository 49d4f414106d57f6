"""The Ray Serve application: a WebSocket ingress speaking `docs/protocol.md`, engine replicas behind it.

Same URL, auth, events and error codes as `tristream serve`: the ingress (a Serve deployment:
by default `DirectIngress`, listening itself; with ``ingress="proxy"`` the FastAPI view below,
behind Serve's HTTP proxy; ``ScaleConfig.n_ingress()``
replicas) authenticates, places the session on an engine replica through the `PoolRouter`
(`ReplicaPool`) and relays frames both ways, batched per replica (`tristream.scale.relay`);
the replica runs the very `RealtimeSession` state machine and backend that the
single-process server runs. Extra routes: ``/metrics`` (every
replica's metrics with a ``replica`` label, plus the pool's), ``/healthz``, ``/readyz`` and
``/scale/placement`` (session → replica, JSON).

Ways to run it:

- ``tristream serve --ray ...`` → `run_ray_server` (the CLI calls it);
- ``serve run tristream/scale/serve_config.yaml`` or
  ``serve run tristream.scale.app:app_builder replicas=2 token=s3cret`` (the assistant, as
  `tristream serve`; ``backend=echo`` for the protocol test backend);
- Python: ``serve.run(build_app(ScaleConfig(...)), route_prefix="/")``.
"""

# No `from __future__ import annotations` here, on purpose: Ray Serve's class-based FastAPI
# view re-resolves route signatures, and a string annotation on a WebSocket parameter makes
# the route unmatched (HTTP 403 on upgrade, seen with Ray 2.60 / FastAPI 0.165).

import contextlib
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve

from tristream.scale.autoscale import AutoscaleConfig
from tristream.scale.direct import AUTH_HELP, DirectIngress, offered_tokens, token_ok
from tristream.scale.pool import ScaleConfig
from tristream.scale.relay import Relay
from tristream.scale.replica import ReplicaSpec
from tristream.scale.router import PoolRouter, Refused
from tristream.scale.session_relay import SocketOps, run_session
from tristream.serve import protocol as P
from tristream.serve.backends import DEFAULT_BACKEND
from tristream.serve.limits import ServerLimits
from tristream.serve.server import KEY_SUBPROTOCOL, WEB_DIR

log = logging.getLogger("tristream.scale")
fastapi_app = FastAPI(title="tristream (Ray Serve)")
_STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
           "style.css": "text/css; charset=utf-8"}


@serve.ingress(fastapi_app)
class RealtimeIngress:
    """The Serve-proxy ingress deployment (``ingress="proxy"``); see the module docstring."""

    def __init__(self, config: ScaleConfig, router: Any) -> None:
        self.config = config
        self.limits: ServerLimits = config.spec.limits
        self.router = router
        self.relay = Relay(self.limits.max_outbox_events, config.spec.poll_wait_s, count=self._count,
                           mode=config.relay)

    def _count(self, name: str, label: str) -> Any:
        return self.router.count.remote(name, label)

    # ------------------------------------------------------------ HTTP side
    @fastapi_app.get("/healthz")
    async def healthz(self) -> Response:
        """200 while the ingress runs."""
        return PlainTextResponse("ok\n")

    @fastapi_app.get("/readyz")
    async def readyz(self) -> Response:
        """200 when some replica accepts sessions."""
        ready = await self.router.ready.remote()
        return PlainTextResponse("ready\n" if ready else "not ready\n", status_code=200 if ready else 503)

    @fastapi_app.get("/scale/placement")
    async def placement(self) -> Response:
        """Session → replica, the replicas' load reports and the autoscaler's target."""
        return JSONResponse(await self.router.placement.remote())

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        """Every replica's metrics with a ``replica`` label, plus the pool's own."""
        body = await self.router.metrics_text.remote()
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
    async def _deny(self, ws: WebSocket, status: int, text: str, reason: str) -> None:
        await self.router.count.remote("refused", reason)
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
        protos = ws.headers.getlist("sec-websocket-protocol")
        if self.config.require_auth and not token_ok(offered_tokens(ws.headers.get("authorization", ""), protos),
                                                     self.config.tokens):
            await self._deny(ws, 401, AUTH_HELP, "auth")
            return
        sub = next((p for p in (x.strip() for pr in protos for x in pr.split(","))
                    if p and not p.startswith(KEY_SUBPROTOCOL)), None)
        sid = P.new_id("sess")
        pipe = self.relay.expect(sid)
        res = await self.router.open_session.remote(self.relay.ingress_id, sid)
        if isinstance(res, Refused):
            self.relay.forget(sid)
            await self._deny(ws, 503, f"{res.message}\n", "max_sessions")
            return
        try:
            await ws.accept(subprotocol=sub)
        except Exception:
            self.relay.forget(sid)
            with contextlib.suppress(Exception):
                await res.handle.close_session.remote(sid, "handshake_failed")
            await self.router.session_ended.remote(sid)
            raise

        async def recv() -> Any:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return None
            data = msg.get("text")
            return data if data is not None else (msg.get("bytes") or b"")

        await run_session(self.relay, self.router, sid, pipe, res, SocketOps(recv, ws.send_text, ws.close),
                          self.limits)


IngressDeployment = serve.deployment(name="tristream_ingress", num_replicas=1,
                                     ray_actor_options={"num_cpus": 0.5},
                                     max_ongoing_requests=100_000)(RealtimeIngress)
DirectDeployment = serve.deployment(name="tristream_ingress", num_replicas=1, ray_actor_options={"num_cpus": 0.5},
                                    max_ongoing_requests=100)(DirectIngress)
RouterDeployment = serve.deployment(name="tristream_router", num_replicas=1, ray_actor_options={"num_cpus": 0.1},
                                    max_ongoing_requests=100_000,
                                    logging_config={"enable_access_log": False})(PoolRouter)  # a line per call


def build_app(config: ScaleConfig) -> Any:
    """The bound Serve application (pass to ``serve.run``): the router and ``config.ingress`` ingress replicas."""
    if config.ingress not in ("direct", "proxy"):
        raise ValueError(f"ingress must be 'direct' or 'proxy', not {config.ingress!r}")
    if config.relay not in ("socket", "ray"):
        raise ValueError(f"relay must be 'socket' or 'ray', not {config.relay!r}")
    router = RouterDeployment.bind(config)
    dep = DirectDeployment if config.ingress == "direct" else IngressDeployment
    return dep.options(num_replicas=config.n_ingress(),
                       ray_actor_options={"num_cpus": config.ingress_cpus}).bind(config, router)


def config_from_args(args: dict[str, Any]) -> ScaleConfig:
    """A `ScaleConfig` from ``serve run`` style string arguments (see `serve_config.yaml`)."""
    def num(key: str, default: float) -> float:
        return float(args.get(key, default))

    replicas = int(num("replicas", 2))
    lo = int(num("min_replicas", replicas))
    hi = int(num("max_replicas", max(replicas, lo)))
    tokens = [t for t in str(args.get("token", "")).split(",") if t]
    backend_kw = json.loads(str(args["backend_kw"])) if "backend_kw" in args else {}
    spec = ReplicaSpec(backend=str(args.get("backend", DEFAULT_BACKEND)), backend_kw=backend_kw,
                       limits=ServerLimits(max_sessions=int(num("max_sessions", 64))),
                       target_p99_ms=num("target_p99_ms", 50.0), target_queue_depth=num("target_queue_depth", 8.0))
    return ScaleConfig(spec=spec, autoscale=AutoscaleConfig(
        lo, hi, upscale_delay_s=num("upscale_delay_s", 5.0), downscale_delay_s=num("downscale_delay_s", 60.0)),
        replica_cpus=num("replica_cpus", 1.0), replica_gpus=num("replica_gpus", 0.0),
        name_prefix=str(args.get("name_prefix", "tristream")), max_sessions_per_replica=int(num("max_sessions", 64)),
        tokens=tokens, require_auth=str(args.get("no_auth", "false")).lower() not in ("1", "true", "yes"),
        ingress=str(args.get("ingress", "direct")), ingress_replicas=int(num("ingress_replicas", 0)),
        relay=str(args.get("relay", "socket")),
        host=str(args.get("host", "127.0.0.1")), port=int(num("port", 8765)))


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

    With ``config.ingress == "direct"`` the ingress replicas listen on ``host:port`` themselves
    and Serve's HTTP proxy is not started; with ``"proxy"`` the proxy listens there.
    ``until``: an optional zero-argument callable polled every 0.5 s; return True to stop
    (the default runs until SIGINT/SIGTERM). Shuts Serve down on the way out.
    """
    import dataclasses

    import ray

    if config.require_auth and not config.tokens:
        raise ValueError("auth is required but no token was given: pass --token (or TRISTREAM_TOKEN), "
                         "or --no-auth for a trusted local demo")
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)
    if config.ingress == "direct":
        config = dataclasses.replace(config, host=host, port=port)
        serve.start(proxy_location="Disabled")
    else:
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
