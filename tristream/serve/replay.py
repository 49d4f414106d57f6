"""Deterministic replay of a recorded session on a virtual clock, and output comparison.

The recorded client messages are fed, in order, to a fresh `RealtimeSession` whose clock is
a `VirtualClock` set to each message's recorded reference time; after each message the
loop runs until the backend has nothing left to do (answers stream with pace 0), so the
result depends only on the recording. Outputs are compared with the recorded ones after
normalising away what legitimately differs (event/item/response ids, latency fields,
the session id), and turn latencies are reported side by side.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tristream.observe.record import RecordedEvent, read_recording
from tristream.sched.clock import VirtualClock
from tristream.serve import protocol as P
from tristream.serve.backend import BackendFactory, SessionBackend
from tristream.serve.limits import ServerLimits
from tristream.serve.session import RealtimeSession, TurnTiming

_VOLATILE = {"event_id", "item_id", "previous_item_id", "response_id", "id", "x_tristream"}


def normalise(event: dict[str, Any]) -> dict[str, Any]:
    """An event without ids and latency fields, for comparison."""
    out: dict[str, Any] = {}
    for k, v in event.items():
        if k in _VOLATILE:
            continue
        if isinstance(v, dict):
            out[k] = normalise(v)
        elif isinstance(v, list):
            out[k] = [normalise(x) if isinstance(x, dict) else x for x in v]
        else:
            out[k] = v
    return out


@dataclass(slots=True)
class ReplayResult:
    """Recorded vs replayed outputs and turn latencies."""

    recorded: list[dict[str, Any]]
    replayed: list[dict[str, Any]]
    recorded_turns: list[dict[str, float]]
    replayed_turns: list[TurnTiming]
    mismatches: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        """True when every normalised output event matches."""
        return not self.mismatches


class ReplayDriver(Protocol):
    """How a backend family is replayed: its clock, its factory, and how virtual time moves."""

    def clock_ns(self) -> int:
        """Virtual now (ns)."""
        ...

    def factory(self) -> SessionBackend:
        """A fresh backend on the virtual clock."""
        ...

    async def advance_to(self, t_ns: int) -> None:
        """Move virtual time to ``t_ns``, letting all work due by then finish first."""
        ...

    async def finish(self) -> None:
        """Run until the backend has nothing left to do."""
        ...


async def _drain(max_iters: int = 100_000) -> None:
    """Run the loop until no other task is runnable (bounded)."""
    me = asyncio.current_task()
    for _ in range(max_iters):
        others = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if not others:
            return
        await asyncio.sleep(0)


class TaskDrainDriver:
    """For backends whose work is short asyncio tasks (`EchoBackend` with pace 0)."""

    def __init__(self, factory: BackendFactory, start_ns: int = 0) -> None:
        self._factory = factory
        self.clock = VirtualClock(start_ns)

    def clock_ns(self) -> int:
        """Virtual now."""
        return self.clock()

    def factory(self) -> SessionBackend:
        """A fresh backend."""
        return self._factory()

    async def advance_to(self, t_ns: int) -> None:
        """Finish pending tasks, then jump."""
        await _drain()
        self.clock.advance_to(t_ns)

    async def finish(self) -> None:
        """Finish pending tasks."""
        await _drain()


def _outputs(events: list[RecordedEvent]) -> list[dict[str, Any]]:
    # Shutdown notices depend on when the server stopped, not on the session's inputs.
    return [e.payload for e in events if e.direction == "out"
            and e.payload.get("error", {}).get("code") != P.E_SHUTTING_DOWN]


def compare(recorded: list[dict[str, Any]], replayed: list[dict[str, Any]], audio: str = "exact") -> list[str]:
    """Mismatches between two output streams after `normalise` (``audio='ignore'`` drops audio deltas)."""
    def keep(e: dict[str, Any]) -> bool:
        return e.get("type") != "session.created" and (audio == "exact" or e.get("type") != "response.audio.delta")

    a = [normalise(e) for e in recorded if keep(e)]
    b = [normalise(e) for e in replayed if keep(e)]
    out: list[str] = []
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            out.append(f"event {i}: recorded {json.dumps(x)[:200]} != replayed {json.dumps(y)[:200]}")
            if len(out) >= 20:
                break
    if len(a) != len(b):
        out.append(f"recorded {len(a)} output events, replayed {len(b)}")
    return out


async def replay_events(events: list[RecordedEvent], factory: BackendFactory | None = None,
                        limits: ServerLimits | None = None, driver: ReplayDriver | None = None,
                        audio: str = "exact") -> ReplayResult:
    """Replay the 'in' events of a recording through a fresh session; compare with its 'out' events."""
    ins = [e for e in events if e.direction == "in"]
    outs = _outputs(events)
    meta = next((e.payload for e in events if e.direction == "meta"), {})
    start = events[0].ref_ns if events else 0
    if driver is None:
        if factory is None:
            raise ValueError("replay needs a backend factory or a replay driver")
        driver = TaskDrainDriver(factory, start)
    else:
        await driver.advance_to(start)
    replayed: list[dict[str, Any]] = []
    lim = limits or ServerLimits(**{k: v for k, v in meta.get("limits", {}).items()
                                    if k in ServerLimits.__dataclass_fields__})
    session = RealtimeSession(meta.get("session_id", "replay"), driver.factory(), replayed.append,
                              driver.clock_ns, lim)
    await session.open()
    for ev in ins:
        await driver.advance_to(ev.ref_ns)
        session.handle_message(ev.raw)
    await driver.finish()
    await session.close()
    result = ReplayResult(outs, replayed, [e.get("x_tristream", {}).get("latency_ms", {}) for e in outs
                                           if e.get("type") == "response.done"], session.turns)
    result.mismatches = compare(outs, replayed, audio)
    return result


def replay_file(path: Path, factory: BackendFactory | None = None, driver: ReplayDriver | None = None,
                audio: str = "exact") -> ReplayResult:
    """Replay one MCAP recording (blocking)."""
    return asyncio.run(replay_events(read_recording(path), factory, driver=driver, audio=audio))
