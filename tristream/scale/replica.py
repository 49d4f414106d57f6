"""`EngineReplica`: one engine replica — a device, its models, its sessions' state.

It runs as a Ray actor (async: every method runs on the actor's event loop, like the
standalone server's) and holds, per session, the same `RealtimeSession` state machine and
`SessionBackend` that `tristream serve` uses, so protocol behaviour is identical. Sessions
are opened and closed by one Ray call each (``open_session``, ``close_session``). The frames
in between travel, by default, over one TCP stream per ingress process (`tristream.scale.wire`:
``relay_endpoint`` starts the listener and hands out its secret): client messages in, every
event of one loop step out in one write. Without a stream (``relay="ray"``) they go by Ray
calls batched across every session an ingress holds here: ``push_many`` (client messages by
session, in order) and ``poll_many`` (a long-poll returning the queued events of every session
of that ingress that has some); ``push`` / ``poll`` remain for a single session. When an
ingress's stream closes, its sessions here are closed (the ingress process is gone).
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

from tristream.observe.gcpause import gc_pauses, settle_heap
from tristream.scale.load import LoadReport, LoadTracker
from tristream.scale.wire import EVENT, Endpoint, WireServer
from tristream.sched.types import UnknownSession
from tristream.serve import protocol as P
from tristream.serve.backend import BackendFactory, family_of
from tristream.serve.backends import DEFAULT_BACKEND
from tristream.serve.limits import ServerLimits
from tristream.serve.metrics import ServeMetrics
from tristream.serve.session import RealtimeSession, TurnTiming


@dataclass(slots=True)
class ReplicaSpec:
    """How to build one replica (plain data: it is pickled to the actor)."""

    backend: str = DEFAULT_BACKEND
    """A `tristream serve --backend` name (the assistant by default; ``echo`` for the protocol
    test backend) or ``module:function`` returning a `BackendFactory`."""
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
    ingress: str = ""
    close_reason: str | None = None


class EngineReplica:
    """See the module docstring. Construct through `tristream.scale.pool` (as a Ray actor)."""

    def __init__(self, replica_id: str, spec: ReplicaSpec) -> None:
        self.replica_id = replica_id
        self.spec = spec
        self.factory = family_of(build_factory(spec))
        self.metrics = ServeMetrics()
        self.metrics.add_collector(self._collect)
        self.load = LoadTracker(spec.target_p99_ms, spec.target_queue_depth)
        self.sessions: dict[str, _Held] = {}
        self.accepting = True
        self.pending_msgs = 0
        self.started_s = time.monotonic()
        self._dirty: dict[str, set[str]] = {}  # ingress -> its sessions with queued events
        self._wakes: dict[str, asyncio.Event] = {}
        self.wire = WireServer(self._on_wire_message, lambda name, reason: self.metrics.inc(name, reason=reason),
                               self._on_ingress_connected, self._on_ingress_lost)
        self._closing: set[asyncio.Task[None]] = set()
        # models are loaded (the factory built them): time collections, freeze the start-up heap
        self.gc = gc_pauses()
        self.metrics.add_collector(self.gc.collect)
        settle_heap()

    async def ready(self) -> dict[str, Any]:
        """Answer once constructed (models loaded): id, pid and visible devices."""
        return {"replica": self.replica_id, "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    # ------------------------------------------------------------ sessions
    async def open_session(self, sid: str, ingress: str = "") -> list[str]:
        """Create a session's state here; returns its first events (``session.created``).

        ``ingress``: the relay that will fetch this session's later events with `poll_many`
        ("" for a caller that polls this session alone with `poll`).
        """
        held: list[_Held] = []

        def send(event: dict[str, Any]) -> None:
            h = held[0]
            if h.close_reason is not None:
                self.metrics.inc("tristream_events_dropped_total", reason="session_closing")
                return
            if h.ingress and not h.outbox:
                outlet = self.wire.outlets.get(h.ingress)
                if outlet is not None:  # the ingress is connected: straight to its socket
                    outlet.send(EVENT, sid, P.dumps(event).encode())
                    return
            if len(h.outbox) >= self.spec.limits.max_outbox_events:
                self.metrics.inc("tristream_events_dropped_total", reason="slow_client")
                self.metrics.inc("tristream_sessions_closed_total", reason="slow_client")
                h.close_reason = f"{P.E_SLOW_CLIENT}: {self.spec.limits.max_outbox_events} events unread"
            else:
                h.outbox.append(P.dumps(event))
            self._mark(sid, h)

        session = RealtimeSession(sid, self.factory(), send, time.monotonic_ns, self.spec.limits, self.metrics,
                                  on_turn=self._on_turn)
        h = _Held(session, deque(), asyncio.Event(), ingress)
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

    async def relay_endpoint(self) -> Endpoint:
        """Where an ingress connects for this replica's frames (`tristream.scale.wire`); starts listening."""
        import ray

        return await self.wire.start(ray.util.get_node_ip_address())

    def _on_wire_message(self, ingress: str, sid: str, data: str | bytes) -> None:
        h = self.sessions.get(sid)
        if h is None or h.ingress != ingress:
            self.metrics.inc("tristream_messages_dropped_total", reason="session_closed")
            return
        h.session.handle_message(data)

    def _on_ingress_connected(self, ingress: str) -> None:
        """Events queued for this ingress before it connected leave now, in order."""
        outlet = self.wire.outlets[ingress]
        for sid in self._dirty.pop(ingress, set()):
            h = self.sessions.get(sid)
            if h is not None and h.close_reason is None:
                for text in h.outbox:
                    outlet.send(EVENT, sid, text.encode())
                h.outbox.clear()

    def _on_ingress_lost(self, ingress: str) -> None:
        """The ingress's relay stream closed: that process is gone (or gave up on this replica), and
        with it its clients' sockets, so its sessions here are closed (``reason="ingress_lost"``)."""
        for sid, h in list(self.sessions.items()):
            if h.ingress == ingress:
                task = asyncio.get_running_loop().create_task(self.close_session(sid, "ingress_lost"))
                self._closing.add(task)  # the loop keeps only weak references to tasks
                task.add_done_callback(self._closing.discard)

    def _mark(self, sid: str, h: _Held) -> None:
        h.wake.set()
        if h.ingress:
            dirty = self._dirty.get(h.ingress)
            if dirty is None:
                dirty = self._dirty[h.ingress] = set()
            dirty.add(sid)
            self._wake(h.ingress).set()

    def _wake(self, ingress: str) -> asyncio.Event:
        ev = self._wakes.get(ingress)
        if ev is None:
            ev = self._wakes[ingress] = asyncio.Event()
        return ev

    async def push_many(self, batch: dict[str, list[str | bytes]]) -> None:
        """Client messages of many sessions (each session's in the order received).

        A session that closed meanwhile has its messages counted as dropped
        (``tristream_messages_dropped_total{reason="session_closed"}``).
        """
        self.metrics.inc("tristream_replica_relay_calls_total", method="push_many")
        for sid, messages in batch.items():
            h = self.sessions.get(sid)
            if h is None:
                self.metrics.inc("tristream_messages_dropped_total", float(len(messages)), reason="session_closed")
                continue
            for raw in messages:
                h.session.handle_message(raw)

    async def poll_many(self, ingress: str, wait_s: float | None = None) -> dict[str, list[str] | None]:
        """Queued events of every session of ``ingress`` that has some, waiting up to ``wait_s``
        for the first. A session mapped to None must close (its client is too slow: its
        unsent events are counted as dropped). One call in flight per ingress."""
        self.metrics.inc("tristream_replica_relay_calls_total", method="poll_many")
        wait = self.spec.poll_wait_s if wait_s is None else wait_s
        dirty = self._dirty.get(ingress)
        if not dirty and wait > 0:
            ev = self._wake(ingress)
            ev.clear()
            try:
                await asyncio.wait_for(ev.wait(), wait)
            except TimeoutError:
                pass
            dirty = self._dirty.get(ingress)
        if not dirty:
            return {}
        self._dirty[ingress] = set()
        out: dict[str, list[str] | None] = {}
        for sid in dirty:
            h = self.sessions.get(sid)
            if h is None:
                continue
            if h.close_reason is not None:
                if h.outbox:
                    self.metrics.inc("tristream_events_dropped_total", float(len(h.outbox)), reason="slow_client")
                    h.outbox.clear()
                out[sid] = None
            elif h.outbox:
                out[sid] = list(h.outbox)
                self.metrics.inc("tristream_replica_relay_events_total", float(len(h.outbox)))
                h.outbox.clear()
        return out

    async def push(self, sid: str, messages: list[str | bytes]) -> None:
        """Client messages of one session, in the order received."""
        self.metrics.inc("tristream_replica_relay_calls_total", method="push")
        h = self._get(sid)
        for raw in messages:
            h.session.handle_message(raw)

    async def poll(self, sid: str, wait_s: float | None = None) -> list[str] | None:
        """Server events queued for a session, waiting up to ``wait_s`` for the first one.

        Returns None when the session must close (slow client); [] on timeout.
        """
        self.metrics.inc("tristream_replica_relay_calls_total", method="poll")
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
        dirty = self._dirty.get(h.ingress)
        if dirty is not None:
            dirty.discard(sid)

    def _on_turn(self, t: TurnTiming) -> None:
        lat = t.latencies_ms().get("eos_to_first_text_ms")
        if lat is not None or t.status == "failed":  # a cancelled answer (barge-in) is not a miss
            self.load.record_turn(time.monotonic_ns(), lat, len(self.sessions))

    # ------------------------------------------------------------ signals
    async def set_accepting(self, accepting: bool) -> None:
        """Stop (or resume) taking new sessions: the pool drains a replica before removing it."""
        self.accepting = accepting

    async def load_report(self) -> LoadReport:
        """The scheduler's load signal for this replica (see `tristream.scale.load`)."""
        queued = sum(1 for h in self.sessions.values() if h.session.responding)
        queued += sum(len(h.outbox) > 0 for h in self.sessions.values())
        rep = self.load.report(self.replica_id, time.monotonic_ns(), len(self.sessions), queued,
                               self.accepting, self.factory.scheduler)
        rep.held = list(self.sessions)
        rep.extra["gc_pause_max_recent_ms"] = round(self.gc.max_recent_s() * 1e3, 3)
        return rep

    async def metrics_text(self) -> str:
        """This replica's Prometheus text (the ingress adds the ``replica`` label)."""
        records, writes = self.wire.totals()
        self.metrics.counters[("tristream_replica_relay_records_total", ())] = float(records)
        self.metrics.counters[("tristream_replica_relay_writes_total", ())] = float(writes)
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
        fams.extend(self.factory.collect())
        return fams
