"""A local Ray cluster (small resources, no dashboard) and the tristream Serve app on loopback."""

from __future__ import annotations

import itertools
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from tests.serve.helpers import TOKEN  # noqa: E402
from tristream.scale.autoscale import AutoscaleConfig  # noqa: E402
from tristream.scale.pool import ScaleConfig  # noqa: E402
from tristream.scale.replica import ReplicaSpec  # noqa: E402
from tristream.serve.limits import ServerLimits  # noqa: E402

_DEPLOYS = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class RayApp:
    """A deployed app: its base URLs, the replica-name prefix and the ingress kind."""

    port: int
    prefix: str
    ingress: str = "direct"
    relay: str = "socket"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


class RayApps:
    """Deploys the app on demand under one name; redeploys only when the settings change."""

    def __init__(self, port: int) -> None:
        self.port = port  # Serve's HTTP proxy (the proxy ingress); the direct ingress gets a port per deploy
        self.key: str | None = None
        self.app: RayApp | None = None

    def get(self, **kw: object) -> RayApp:
        key = repr(sorted(kw.items()))
        if self.app is None or key != self.key:
            self.app = deploy(self.port, "tristream", **kw)  # type: ignore[arg-type]
            self.key = key
        return self.app


@pytest.fixture(scope="session")
def ray_apps() -> Iterator[RayApps]:
    """Ray (4 logical CPUs on whatever cores exist) with Serve's HTTP proxy on a free port."""
    ray.init(num_cpus=4, object_store_memory=128 << 20, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True,
             configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield RayApps(port)
    serve.shutdown()
    ray.shutdown()


def deploy(port: int, name: str, backend: str = "echo", replicas: int = 2, max_replicas: int | None = None,
           limits: ServerLimits | None = None, max_sessions_total: int = 0, ingress: str = "direct",
           ingress_replicas: int = 0, relay: str = "socket", **spec_kw: object) -> RayApp:
    """Deploy the app (blocks until every replica has loaded its models) and wait for /readyz.

    ``ingress="direct"``: the ingress replicas listen on a fresh port (SO_REUSEPORT, one port
    for all of them; a fresh one per deploy so a draining old listener never takes a test's
    connection); ``"proxy"``: through Serve's HTTP proxy on ``port``.
    """
    from tristream.scale.app import build_app

    direct_port = free_port() if ingress == "direct" else 0
    cfg = ScaleConfig(spec=ReplicaSpec(backend=backend, limits=limits or ServerLimits(), **spec_kw),  # type: ignore[arg-type]
                      autoscale=AutoscaleConfig(replicas, max_replicas or replicas, upscale_delay_s=0.5,
                                                downscale_delay_s=3600.0),
                      replica_cpus=0.5, name_prefix=f"{name}{next(_DEPLOYS)}", tokens=[TOKEN],
                      autoscale_interval_s=0.25, max_sessions_total=max_sessions_total, ingress=ingress,
                      ingress_replicas=ingress_replicas, ingress_cpus=0.25, port=direct_port, relay=relay,
                      pin_grace_s=1.0)
    serve.run(build_app(cfg), name=name, route_prefix="/")
    app = RayApp(direct_port or port, cfg.name_prefix, ingress, relay)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if app.get("/readyz", 5)[0] == 200:
                return app
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the Ray app never became ready")


@pytest.fixture(scope="module", params=["direct", "proxy"])
def ingress(request: pytest.FixtureRequest) -> str:
    """Each Ray test runs through both ingress kinds (module scope: pytest groups the tests by
    kind, so the shared app is redeployed once per kind, not per test)."""
    return str(request.param)


@pytest.fixture()
def echo_app(ray_apps: RayApps, ingress: str) -> RayApp:
    """Two echo replicas behind the Ray ingress (shared until another test needs other settings).

    ``ingress`` is ``direct`` or ``proxy`` (frames over the socket relay), or ``direct/ray``
    (frames by batched Ray actor calls)."""
    kind, _, relay = ingress.partition("/")
    return ray_apps.get(ingress=kind, relay=relay or "socket")
