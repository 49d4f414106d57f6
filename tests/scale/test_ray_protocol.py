"""The serving issue's protocol tests, unchanged, through the Ray ingress (2 echo replicas), direct and proxy.

`tests/serve/test_server.py` talks to a server made by its ``running_server`` helper and
reads ``url(srv)``, ``srv.port`` and ``srv.metrics.count(...)``. Here those names point at the
Ray Serve app instead: ``running_server(limits=...)`` deploys (or reuses) the app with the
same limits, ``srv.metrics.count`` sums the merged ``/metrics`` over the ``replica`` label.
The test functions themselves are imported and run as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

import tests.serve.test_server as T
from tests.scale.conftest import RayApp, RayApps
from tristream.scale.prom import parse_samples
from tristream.serve.limits import ServerLimits


class MergedMetrics:
    """``count(name, **labels)`` over the Ray app's merged /metrics (summed over replicas)."""

    def __init__(self, app: RayApp) -> None:
        self.app = app

    def count(self, name: str, **labels: str) -> float:
        want = set(labels.items())
        samples = parse_samples(self.app.get("/metrics")[1])
        return sum(v for (n, lab), v in samples.items()
                   if n == name and want <= set(lab) and {k for k, _ in lab} - {"replica"} == set(labels))


class RayServerView:
    """What the serve tests read from a server object."""

    def __init__(self, app: RayApp) -> None:
        self.port = app.port
        self.metrics = MergedMetrics(app)


@pytest.fixture()
def via_ray(ray_apps: RayApps, ingress: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Point test_server's ``running_server`` at the Ray app (counters are read as deltas)."""

    @contextlib.asynccontextmanager
    async def running_server(tmp: Any = None, **kw: Any) -> AsyncIterator[RayServerView]:
        limits: ServerLimits = kw.pop("limits", None) or ServerLimits()
        assert not kw, f"unsupported server options through Ray: {kw}"
        import asyncio

        app = await asyncio.get_running_loop().run_in_executor(
            # Paced echo: through the proxy a second message can arrive after an instant (pace 0)
            # answer has already finished, which made the out-of-order check racy.
            None, lambda: ray_apps.get(limits=limits, max_sessions_total=limits.max_sessions,
                                       backend_kw={"pace": 0.5}, ingress=ingress, ingress_replicas=1))
        view = RayServerView(app)
        base = MergedMetrics(app)
        before: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        count = base.count

        def delta(name: str, **labels: str) -> float:  # the app is shared: count from this test's start
            key = (name, tuple(sorted(labels.items())))
            return count(name, **labels) - before.setdefault(key, 0.0)

        for name, labels in _COUNTED:
            before[(name, tuple(sorted(labels.items())))] = count(name, **labels)
        view.metrics.count = delta  # type: ignore[method-assign]
        yield view

    monkeypatch.setattr(T, "running_server", running_server)
    yield lambda: None


_COUNTED: list[tuple[str, dict[str, str]]] = [
    ("tristream_connections_refused_total", {"reason": "auth"}),
    ("tristream_client_errors_total", {"code": "message_too_large"}),
    ("tristream_messages_dropped_total", {"reason": "rate_limited"}),
    ("tristream_sessions_total", {}),
]


ALL = [T.test_auth_required, T.test_manual_commit_without_vad, T.test_output_audio_is_the_echoed_turn,
       T.test_bad_messages_get_errors_and_session_survives, T.test_rate_limit_drops_are_counted,
       T.test_twenty_concurrent_clients_audio_and_video, T.test_max_sessions, T.test_session_length_limit]
# The proxy ingress shares the relay, the router and the replica with the direct one; what is
# its own is the handshake (401 and 503 through the ASGI denial extension) and the socket
# adapter, which these exercise. (The default-limits tests come first: fewer redeploys.)
PROXY = [T.test_auth_required, T.test_twenty_concurrent_clients_audio_and_video, T.test_max_sessions]


@pytest.mark.parametrize(("ingress", "test"), [("direct", t) for t in ALL] + [("proxy", t) for t in PROXY],
                         ids=lambda x: x if isinstance(x, str) else x.__name__)
def test_serve_protocol_through_ray(via_ray: Callable[[], None], test: Callable[[], None]) -> None:
    test()
