"""`PoolRouter`: the one place that owns the engine replicas, shared by every ingress process.

The ingress replicas (direct WebSocket listeners or Serve-proxy FastAPI views, as many as
configured) call it once per session: ``open_session`` places the session (least-loaded,
`ReplicaPool`) and returns the engine replica's actor handle, so the session's frames then go
straight from that ingress to that replica without passing here; ``session_ended`` and
``replica_failed`` keep the pins and the failure count right. Placement, ``max_sessions_total``,
autoscaling and the merged ``/metrics`` are therefore global, whichever ingress a client hit.

It runs as a Serve deployment with one replica (`tristream.scale.app.build_app` binds it).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from tristream.scale.pool import NoReplicaAvailable, ReplicaPool, ScaleConfig
from tristream.scale.prom import merge
from tristream.serve.metrics import fmt_value

log = logging.getLogger("tristream.scale")


@dataclass(slots=True)
class Opened:
    """A session placed on an engine replica (crosses process boundaries)."""

    replica: str
    handle: Any
    first: list[str]


@dataclass(slots=True)
class Refused:
    """No replica can take the session (the ingress answers HTTP 503 with ``message``)."""

    message: str


class PoolRouter:
    """See the module docstring."""

    async def __init__(self, config: ScaleConfig) -> None:  # type: ignore[misc]  # Ray allows async constructors
        self.config = config
        self.pool = ReplicaPool(config)
        await self.pool.start_async()
        self.counters: dict[tuple[str, str], float] = {}
        self._scaler = asyncio.get_running_loop().create_task(self._scale_loop())

    async def _scale_loop(self) -> None:
        while True:
            try:
                await self.pool.autoscale_once()
            except Exception:  # the loop must survive a bad tick; the next one retries
                log.exception("autoscale tick failed")
            await asyncio.sleep(self.config.autoscale_interval_s)

    async def open_session(self, ingress: str, sid: str) -> Opened | Refused:
        """Place session ``sid`` (its events will be polled by ``ingress``)."""
        try:
            ref, sid, first = await self.pool.open_session(sid, ingress)
        except NoReplicaAvailable as exc:
            return Refused(str(exc))
        return Opened(ref.id, ref.handle, first)

    async def session_ended(self, sid: str) -> None:
        """Forget a finished session's pin."""
        self.pool.session_ended(sid)

    async def replica_failed(self, replica: str) -> None:
        """An ingress saw a replica's actor die (its sessions are lost)."""
        self.pool.mark_dead(replica)

    async def count(self, name: str, label: str = "", n: float = 1.0) -> None:
        """Add to an ingress counter (refused connections, relay drops) kept here for every ingress."""
        self.counters[(name, label)] = self.counters.get((name, label), 0.0) + n

    async def ready(self) -> bool:
        """True when some replica accepts sessions."""
        return any(self.pool.admits(r) for r in await self.pool.reports())

    async def placement(self) -> dict[str, Any]:
        """Session → replica, the replicas' load reports and the autoscaler's target."""
        reports = await self.pool.reports()
        return {"placement": self.pool.placement(), "ingress": dict(self.pool.ingress_of),
                "desired": self.pool.desired, "failures": self.pool.failures, "pins_pruned": self.pool.pruned,
                "replicas": [{**r.to_dict(), "pressure": min(r.pressure, 1e9), "admits": self.pool.admits(r)}
                             for r in reports]}

    async def metrics_text(self) -> str:
        """Every replica's metrics with a ``replica`` label, plus the pool's and the ingresses' own."""
        texts = await self.pool.metrics_texts()
        reps = self.pool.last_reports
        lines = ["# HELP tristream_scale_replicas engine replicas by state", "# TYPE tristream_scale_replicas gauge",
                 f'tristream_scale_replicas{{state="live"}} {len(self.pool.live())}',
                 f'tristream_scale_replicas{{state="desired"}} {self.pool.desired}',
                 "# HELP tristream_scale_replica_failures_total replicas that died",
                 "# TYPE tristream_scale_replica_failures_total counter",
                 f"tristream_scale_replica_failures_total {self.pool.failures}",
                 "# HELP tristream_scale_pins_pruned_total pins dropped because the replica no longer held the "
                 "session (its ingress died)",
                 "# TYPE tristream_scale_pins_pruned_total counter",
                 f"tristream_scale_pins_pruned_total {self.pool.pruned}",
                 "# HELP tristream_scale_replica_pressure load signal (max of queue and P99 over target)",
                 "# TYPE tristream_scale_replica_pressure gauge"]
        lines += [f'tristream_scale_replica_pressure{{replica="{r.replica}"}} {fmt_value(min(r.pressure, 1e9))}' for r in reps]
        lines += ["# HELP tristream_scale_sessions_routed_total sessions placed per replica",
                  "# TYPE tristream_scale_sessions_routed_total counter"]
        lines += [f'tristream_scale_sessions_routed_total{{replica="{r.id}"}} {r.routed}' for r in self.pool.live()]
        for name, help_ in (("refused", "tristream_connections_refused_total refused at the ingress"),
                            ("relay_dropped", "tristream_scale_relay_dropped_total frames the ingress relay dropped")):
            metric = help_.split()[0]
            lines += [f"# HELP {help_}", f"# TYPE {metric} counter"]
            lines += [f'{metric}{{reason="{lab}"}} {fmt_value(v)}' for (n, lab), v in sorted(self.counters.items()) if n == name]
        return merge(texts) + "\n".join(lines) + "\n"
