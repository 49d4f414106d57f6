"""`EngineReplica`: one engine replica — a device, its models, its sessions' state.

It runs as a Ray actor (async: every method runs on the actor's event loop, like the
standalone server's) and holds, per session, the same `RealtimeSession` state machine and
`SessionBackend` that `tristream serve` uses, so protocol behaviour is identical. The
ingress talks to it with four calls per session: ``open_session``, ``push`` (client
messages, in order, batched), ``poll`` (server events, long-poll) and ``close_session``.
``load_report`` gives the router and autoscaler the scheduler's load signal
(`tristream.scale.load`); ``metrics_text`` the replica's Prometheus text.

Nothing is dropped silently: events for a client whose outbox overflows are counted
(``tristream_events_dropped_total{reason="slow_client"}``) and the session is closed.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tristream.scale.load import LoadReport, LoadTracker
from tristream.serve import protocol as P
from tristream.serve.backend import BackendFactory
from tristream.serve.limits import ServerLimits
from tristream.serve.metrics import ServeMetrics
from tristream.serve.session import RealtimeSession, TurnTiming


class UnknownSession(KeyError):
    """A call for a session this replica does not hold (it closed, or lived on another replica)."""


@dataclass(slots=True)
class ReplicaSpec:
    """How to build one replica (plain data: it is pickled to the actor)."""

    backend: str = "echo"
    """``echo``, ``pipeline`` or ``module:function`` returning a `BackendFactory`."""
    backend_kw: dict[str, Any] = field(default_factory=dict)
    limits: ServerLimits = field(default_factory=ServerLimits)
    target_p99_ms: float = 50.0
    target_queue_depth: float = 8.0
    poll_wait_s: float = 1.0


def build_factory(spec: ReplicaSpec) -> BackendFactory:
    """The backend factory a spec names (loads the models of this replica once)."""
    if ":" in spec.backend:
        mod, fn = spec.backend.split(":", 1)
        factory: BackendFactory = getattr(importlib.import_module(mod), fn)(**spec.backend_kw)
        return factory
    from tristream.serve.backends import make_factory

    if spec.backend == "pipeline" and spec.backend_kw:
        from tristream.serve.pipeline_backend import pipeline_factory

        return pipeline_factory(**spec.backend_kw)
    return make_factory(spec.backend, **spec.backend_kw)


@dataclass(slots=True)
class _Held:
    session: RealtimeSession
    outbox: deque[str]
    wake: asyncio.Event
    close_reason: str | None = None


class EngineReplica:
    """See the module docstring. Construct through `tristream.scale.pool` (as a Ray actor)."""

    def __init__(self, replica_id: str, spec: ReplicaSpec) -> None:
        self.replica_id = replica_id
        self.spec = spec
        self.factory = build_factory(spec)
        self.metrics = ServeMetrics()
        self.metrics.add_collector(self._collect)
        self.load = LoadTracker(spec.target_p99_ms, spec.target_queue_depth)
        self.sessions: dict[str, _Held] = {}
        self.accepting = True
        self.pending_msgs = 0
        self.started_s = time.monotonic()

    async def ready(self) -> dict[str, Any]:
        """Answer once constructed (models loaded): id, pid and visible devices."""
        return {"replica": self.replica_id, "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    # ------------------------------------------------------------ sessions
    async def open_session(self, sid: str) -> list[str]:
        """Create a session's state here; returns its first events (``session.created``)."""
        held: list[_Held] = []

        def send(event: dict[str, Any]) -> None:
            h = held[0]
            if h.close_reason is not None:
                self.metrics.inc("tristream_events_dropped_total", reason="session_closing")
                return
            if len(h.outbox) >= self.spec.limits.max_outbox_events:
                self.metrics.inc("tristream_events_dropped_total", reason="slow_client")
                self.metrics.inc("tristream_sessions_closed_total", reason="slow_client")
                h.close_reason = f"{P.E_SLOW_CLIENT}: {self.spec.limits.max_outbox_events} events unread"
            else:
                h.outbox.append(P.dumps(event))
            h.wake.set()

        session = RealtimeSession(sid, self.factory(), send, time.monotonic_ns, self.spec.limits, self.metrics,
                                  on_turn=self._on_turn)
        h = _Held(session, deque(), asyncio.Event())
        held.append(h)
        self.sessions[sid] = h
        self.metrics.inc("tristream_sessions_total")
        await session.open()
        return await self.poll(sid, 0.0) or []

    def _get(self, sid: str) -> _Held:
        h = self.sessions.get(sid)
        if h is None:
            raise UnknownSession(f"session {sid} is not held by replica {self.replica_id}")
        return h

    async def push(self, sid: str, messages: list[str | bytes]) -> None:
        """Client messages of one session, in the order received."""
        h = self._get(sid)
        for raw in messages:
            h.session.handle_message(raw)

    async def poll(self, sid: str, wait_s: float | None = None) -> list[str] | None:
        """Server events queued for a session, waiting up to ``wait_s`` for the first one.

        Returns None when the session must close (slow client); [] on timeout.
        """
        h = self._get(sid)
        wait = self.spec.poll_wait_s if wait_s is None else wait_s
        if not h.outbox and h.close_reason is None and wait > 0:
            h.wake.clear()
            try:
                await asyncio.wait_for(h.wake.wait(), wait)
            except TimeoutError:
                pass
        out = list(h.outbox)
        h.outbox.clear()
        if not out and h.close_reason is not None:
            return None
        return out

    async def close_session(self, sid: str, reason: str = "client_closed") -> None:
        """Free the session's state (its backend stops; later events are counted as dropped)."""
        h = self.sessions.pop(sid, None)
        if h is None:
            return
        if h.close_reason is None:
            self.metrics.inc("tristream_sessions_closed_total", reason=reason)
        await h.session.close()
        h.wake.set()

    def _on_turn(self, t: TurnTiming) -> None:
        lat = t.latencies_ms().get("eos_to_first_text_ms")
        if lat is not None or t.status == "failed":  # a cancelled answer (barge-in) is not a miss
            self.load.record_turn(time.monotonic_ns(), lat)

    # ------------------------------------------------------------ signals
    async def set_accepting(self, accepting: bool) -> None:
        """Stop (or resume) taking new sessions: the pool drains a replica before removing it."""
        self.accepting = accepting

    async def load_report(self) -> LoadReport:
        """The scheduler's load signal for this replica (see `tristream.scale.load`)."""
        queued = sum(1 for h in self.sessions.values() if h.session._response is not None)
        queued += sum(len(h.outbox) > 0 for h in self.sessions.values())
        return self.load.report(self.replica_id, time.monotonic_ns(), len(self.sessions), queued,
                                self.accepting, getattr(self.factory, "scheduler", None))

    async def metrics_text(self) -> str:
        """This replica's Prometheus text (the ingress adds the ``replica`` label)."""
        return self.metrics.render()

    def _collect(self) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
        rep = self.load.report(self.replica_id, time.monotonic_ns(), len(self.sessions), 0)
        fams: list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]] = [
            ("tristream_sessions_active", "gauge", "open realtime sessions",
             [("tristream_sessions_active", {}, float(len(self.sessions)))]),
            ("tristream_session_outbox_depth", "gauge", "server events queued for a client",
             [("tristream_session_outbox_depth", {"session": sid}, float(len(h.outbox)))
              for sid, h in self.sessions.items()]),
            ("tristream_replica_response_p99_seconds", "gauge",
             "windowed end of turn -> first text P99 (the scheduler's latency window)",
             [("tristream_replica_response_p99_seconds", {}, (rep.p99_ms or 0.0) / 1e3)]),
        ]
        totals: dict[str, float] = {}
        for h in self.sessions.values():
            counters = getattr(h.session.backend, "counters", None)
            for k, v in (counters() if counters else {}).items():
                totals[k] = totals.get(k, 0.0) + v
        fams.append(("tristream_backend_counter", "gauge", "backend counters summed over open sessions",
                     [("tristream_backend_counter", {"name": k}, v) for k, v in sorted(totals.items())]))
        for h in self.sessions.values():
            gauges = getattr(h.session.backend, "gauges", None)
            if gauges is not None:
                fams.extend(gauges())
        collect = getattr(self.factory, "collect", None)
        if collect is not None:
            fams.extend(collect())
        return fams
