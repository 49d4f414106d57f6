"""`ReplicaPool`: engine replicas as Ray actors, sessions pinned to the replica holding them.

Why not a plain Serve deployment handle for the engines: Serve's router picks a replica per
request (power of two choices on queue length), and a session's KV cache, VAD/ASR state and
conversation live in one replica, so every message of a session must reach that replica.
The pool therefore owns the engine actors (one per device: ``num_gpus=1`` each on GPU) and
routes itself:

- placement: a new session goes to the accepting replica with the lowest pressure in its
  `LoadReport` (queue depth and response P99 against target — the scheduler's signal),
  ties broken by session count (opens still in flight included);
- affinity: the session id maps to its replica until the session ends;
- failure: a call that fails because the actor died marks the replica dead; its sessions'
  calls fail (the ingress tells each client ``replica_failed`` and closes), other replicas
  are untouched, and the autoscaler brings the fleet back to ``min_replicas``;
- autoscaling: `Autoscaler` on the reports, within bounds; a replica to remove first stops
  accepting and is killed when its last session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from tristream.scale.autoscale import AutoscaleConfig, Autoscaler
from tristream.scale.load import LoadReport, least_loaded
from tristream.scale.replica import EngineReplica, ReplicaSpec
from tristream.serve import protocol as P

log = logging.getLogger("tristream.scale")
NAMESPACE = "tristream"
E_REPLICA_FAILED = "replica_failed"
try:  # newer Ray: a transiently unreachable actor
    from ray.exceptions import ActorUnavailableError

    DEAD_ERRORS: tuple[type[BaseException], ...] = (RayActorError, ActorUnavailableError)
except ImportError:  # pragma: no cover
    DEAD_ERRORS = (RayActorError,)


class NoReplicaAvailable(Exception):
    """Every replica is dead, draining or full: the client should retry later (HTTP 503)."""


class ReplicaFailed(Exception):
    """The replica holding a session died; the client may reconnect (to another replica)."""


@dataclass(slots=True)
class ScaleConfig:
    """Everything the Ray app needs (plain data: it is pickled into the ingress deployment)."""

    spec: ReplicaSpec = field(default_factory=ReplicaSpec)
    autoscale: AutoscaleConfig = field(default_factory=lambda: AutoscaleConfig(2, 2))
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    name_prefix: str = "tristream"
    start_timeout_s: float = 900.0
    autoscale_interval_s: float = 1.0
    report_timeout_s: float = 10.0
    report_max_age_s: float = 0.25
    """Placement uses load reports at most this old: a burst of new sessions (a reconnect storm)
    costs one round of report calls shared by every open in flight, not one round per session;
    the router's own session counts (always current) break ties within the window."""
    max_sessions_per_replica: int = 64
    max_sessions_total: int = 0
    """Sessions across the app before new ones get HTTP 503 (0: replicas × per-replica limit)."""
    pin_grace_s: float = 10.0
    """A pin whose session the replica no longer reports is dropped after this long (an ingress
    that died never said ``session_ended``; the grace covers opens racing the report)."""
    tokens: list[str] = field(default_factory=list)
    require_auth: bool = True
    ingress: str = "direct"
    """``direct``: the ingress replicas listen on ``host:port`` themselves (`tristream.scale.direct`);
    ``proxy``: clients go through Serve's HTTP proxy to a FastAPI ingress (`tristream.scale.app`)."""
    relay: str = "socket"
    """Frames between ingress and replica: ``socket`` (a framed TCP stream per pair,
    `tristream.scale.wire`) or ``ray`` (batched actor calls ``push_many`` / ``poll_many``)."""
    ingress_replicas: int = 0
    """Ingress processes (0: one per initial engine replica); direct ones share ``port`` (SO_REUSEPORT)."""
    ingress_cpus: float = 0.5
    host: str = "127.0.0.1"
    port: int = 8765
    """Where the direct ingress listens (the proxy path listens where ``serve.start`` put the proxy)."""

    def n_ingress(self) -> int:
        """How many ingress replicas to run."""
        return self.ingress_replicas if self.ingress_replicas > 0 else max(1, self.autoscale.min_replicas)


@dataclass(slots=True)
class ReplicaRef:
    """The pool's view of one engine replica."""

    id: str
    handle: Any
    sessions: set[str] = field(default_factory=set)
    accepting: bool = True
    alive: bool = True
    routed: int = 0


def replica_failed_event(replica: str) -> dict[str, Any]:
    """The ``error`` event a session gets when its replica dies."""
    return P.server_event("error", error={
        "type": "server_error", "code": E_REPLICA_FAILED, "param": None, "event_id": None,
        "message": f"the engine replica {replica} holding this session failed; its conversation state is lost. "
                   "Reconnect: the new session goes to a healthy replica"})


class ReplicaPool:
    """See the module docstring. Lives in the router (`tristream.scale.router`; needs Ray initialised)."""

    def __init__(self, config: ScaleConfig) -> None:
        self.config = config
        self.replicas: dict[str, ReplicaRef] = {}
        self.owner: dict[str, str] = {}
        self.pinned_at: dict[str, float] = {}
        self.ingress_of: dict[str, str] = {}
        self.pruned = 0
        self.pending: dict[str, int] = {}
        self.autoscaler = Autoscaler(config.autoscale)
        self.failures = 0
        self.desired = config.autoscale.min_replicas
        self.last_reports: list[LoadReport] = []
        self._reports_at: float | None = None
        self._refresh: asyncio.Future[list[LoadReport]] | None = None
        self.report_rounds = 0
        self._ids = itertools.count()
        self._spawning: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ lifecycle
    def _spawn(self) -> ReplicaRef:
        rid = f"{self.config.name_prefix}-replica-{next(self._ids)}"
        actor = ray.remote(EngineReplica).options(
            name=rid, namespace=NAMESPACE, num_cpus=self.config.replica_cpus, num_gpus=self.config.replica_gpus,
            max_restarts=0, max_concurrency=1000)
        return ReplicaRef(rid, actor.remote(rid, self.config.spec))

    def start(self) -> None:
        """Start ``min_replicas`` replicas and wait until each has loaded its models (blocking)."""
        refs = [self._spawn() for _ in range(self.config.autoscale.min_replicas)]
        ray.get([r.handle.ready.remote() for r in refs], timeout=self.config.start_timeout_s)
        for r in refs:
            self.replicas[r.id] = r

    async def start_async(self) -> None:
        """`start` for an event loop (the router deployment's constructor)."""
        refs = [self._spawn() for _ in range(self.config.autoscale.min_replicas)]
        await asyncio.wait_for(asyncio.gather(*(r.handle.ready.remote() for r in refs)), self.config.start_timeout_s)
        for r in refs:
            self.replicas[r.id] = r

    async def _grow(self) -> None:
        ref = self._spawn()
        self._spawning.add(ref.id)
        try:
            await asyncio.wait_for(ref.handle.ready.remote(), self.config.start_timeout_s)
            self.replicas[ref.id] = ref
            log.info("replica %s started", ref.id)
        except Exception:  # timeout or died while loading: give the slot back, the next tick retries
            log.exception("replica %s failed to start", ref.id)
            ray.kill(ref.handle)
        finally:
            self._spawning.discard(ref.id)

    def live(self) -> list[ReplicaRef]:
        """Replicas not known to be dead."""
        return [r for r in self.replicas.values() if r.alive]

    def mark_dead(self, rid: str) -> list[str]:
        """Record a replica failure; returns the sessions it held (now lost)."""
        ref = self.replicas.pop(rid, None)
        if ref is None or not ref.alive:
            return []
        ref.alive = False
        self.failures += 1
        # An ingress may report a replica whose process still runs (only its relay stream broke):
        # make the verdict true, so its device is free for the replacement and nothing is orphaned.
        with contextlib.suppress(Exception):
            ray.kill(ref.handle, no_restart=True)
        lost = sorted(ref.sessions)
        for sid in lost:
            self._unpin(sid)
        log.warning("replica %s failed; %d sessions lost", rid, len(lost))
        return lost

    # ------------------------------------------------------------ routing
    def admits(self, report: LoadReport) -> bool:
        """Whether a new session may go to `report`'s replica now: the replica accepts (its own
        flag), the pool has not drained it, and it is below the per-replica session cap counting
        the opens placed on it since (the one place this rule lives)."""
        ref = self.replicas.get(report.replica)
        if ref is None or not (ref.alive and report.accepting and ref.accepting):
            return False
        return self._placed(ref) < self.config.max_sessions_per_replica

    def _placed(self, ref: ReplicaRef) -> int:
        """Sessions on `ref`, counting opens placed on it that are still in flight."""
        return len(ref.sessions) + self.pending.get(ref.id, 0)

    async def reports(self) -> list[LoadReport]:
        """Load reports of every live replica, each with the replica's own `accepting` flag
        (`admits` adds the pool's rule); a replica that died is marked dead here."""
        live = self.live()
        res = await asyncio.gather(*(asyncio.wait_for(r.handle.load_report.remote(), self.config.report_timeout_s)
                                     for r in live), return_exceptions=True)
        out: list[LoadReport] = []
        for r, rep in zip(live, res, strict=True):
            if isinstance(rep, DEAD_ERRORS):
                self.mark_dead(r.id)
            elif isinstance(rep, LoadReport):
                if rep.held is not None:
                    self._prune(r, set(rep.held))
                out.append(rep)
        self.last_reports = out
        self._reports_at = time.monotonic()
        self.report_rounds += 1
        return out

    async def recent_reports(self) -> list[LoadReport]:
        """`reports`, reused while younger than ``config.report_max_age_s``; callers that arrive
        while a refresh is in flight wait for that one instead of starting their own."""
        at = self._reports_at
        if at is not None and time.monotonic() - at <= self.config.report_max_age_s:
            return self.last_reports
        task = self._refresh
        if task is None or task.done():
            task = self._refresh = asyncio.ensure_future(self.reports())
        return await asyncio.shield(task)

    async def open_session(self, sid: str | None = None, ingress: str = "") -> tuple[ReplicaRef, str, list[str]]:
        """Place a new session on the least-loaded replica; returns (replica, session id, first events).

        ``sid``: the id to give it (default: a new one); ``ingress``: the relay that will
        poll its events (`EngineReplica.poll_many`).
        """
        cap = self.config.max_sessions_total
        if cap and len(self.owner) + sum(self.pending.values()) >= cap:
            raise NoReplicaAvailable(f"server full: {cap} sessions")
        for _ in range(3):
            live = {r.id: r for r in self.live()}
            counts = {rid: self._placed(r) for rid, r in live.items()}
            # a cached report may be up to report_max_age_s old: `admits` re-checks what changed
            # since (the replica died or was drained, or it filled up with the opens placed since)
            reports = [replace(rep, accepting=self.admits(rep))
                       for rep in await self.recent_reports() if rep.replica in live]
            choice = least_loaded(reports, counts)
            if choice is None:
                break
            ref = self.replicas[choice.replica]
            sid = sid or P.new_id("sess")
            self.pending[ref.id] = self.pending.get(ref.id, 0) + 1
            try:
                first = await ref.handle.open_session.remote(sid, ingress)
            except DEAD_ERRORS:
                self.mark_dead(ref.id)
                continue
            finally:
                self.pending[ref.id] -= 1
            ref.sessions.add(sid)
            ref.routed += 1
            self.owner[sid] = ref.id
            self.pinned_at[sid] = time.monotonic()
            self.ingress_of[sid] = ingress
            return ref, sid, first
        raise NoReplicaAvailable(f"no engine replica can take a session now ({len(self.live())} live, "
                                 f"{self.config.max_sessions_per_replica} sessions each at most); retry later")

    def session_ended(self, sid: str) -> None:
        """Forget a finished session's pin (the replica already freed its state)."""
        rid = self._unpin(sid)
        ref = self.replicas.get(rid or "")
        if ref is not None:
            ref.sessions.discard(sid)

    def _unpin(self, sid: str) -> str | None:
        self.pinned_at.pop(sid, None)
        self.ingress_of.pop(sid, None)
        return self.owner.pop(sid, None)

    def _prune(self, ref: ReplicaRef, held: set[str]) -> None:
        """Drop pins of sessions the replica no longer holds (their ingress died without saying so)."""
        cutoff = time.monotonic() - self.config.pin_grace_s
        for sid in [s for s in ref.sessions if s not in held and self.pinned_at.get(s, 0.0) < cutoff]:
            ref.sessions.discard(sid)
            self._unpin(sid)
            self.pruned += 1
            log.warning("session %s is gone from replica %s without an end from its ingress; pin dropped",
                        sid, ref.id)

    def placement(self) -> dict[str, str]:
        """Session id → replica id, for every live session."""
        return dict(self.owner)

    # ------------------------------------------------------------ scaling
    async def autoscale_once(self, now_s: float | None = None) -> int:
        """One autoscaler step: grow, drain or remove replicas towards the desired count."""
        now = time.monotonic() if now_s is None else now_s
        reports = await self.reports()
        desired = self.autoscaler.desired(reports, now)
        self.desired = desired
        # Decide on the replicas that reported: one that joined while the reports were in
        # flight must not be drained for a count computed without it.
        active = [self.replicas[r.replica] for r in reports
                  if r.replica in self.replicas and self.replicas[r.replica].accepting]
        grow = desired - len(active) - len(self._spawning)
        for _ in range(max(0, grow)):
            task = asyncio.get_running_loop().create_task(self._grow())
            self._tasks.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._tasks.discard)
        if desired < len(active):
            victim = min(active, key=lambda r: (len(r.sessions), r.id))
            victim.accepting = False
            try:
                await victim.handle.set_accepting.remote(False)
            except DEAD_ERRORS:
                self.mark_dead(victim.id)
        for r in list(self.live()):
            if not r.accepting and not r.sessions:
                self.replicas.pop(r.id, None)
                ray.kill(r.handle)
                log.info("replica %s removed (scaled down)", r.id)
        return desired

    async def metrics_texts(self) -> list[tuple[str, str]]:
        """(replica id, Prometheus text) of every live replica."""
        live = self.live()
        res = await asyncio.gather(*(asyncio.wait_for(r.handle.metrics_text.remote(), self.config.report_timeout_s)
                                     for r in live), return_exceptions=True)
        out = []
        for r, text in zip(live, res, strict=True):
            if isinstance(text, DEAD_ERRORS):
                self.mark_dead(r.id)
            elif isinstance(text, str):
                out.append((r.id, text))
        return out


__all__ = ["DEAD_ERRORS", "GetTimeoutError", "NoReplicaAvailable", "ReplicaFailed", "ReplicaPool", "ScaleConfig"]
