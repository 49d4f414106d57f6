"""Asyncio stage runtime: one task per stage, bounded two-lane inboxes, interruption.

A `Stage` handles one packet at a time in its own task. Its `process` may be a plain
function (no coroutine is created per packet) or a coroutine function (for stages that
await a model in a thread or a network stream). Packets go downstream with the
synchronous `emit`; backpressure is applied by the run loop, which waits for space in a
blocking downstream inbox before it takes the next packet.

Interruption is synchronous: `Stage.interrupt()` drops the queued data (counted under
`interrupted`), cancels the packet in flight, if any, and calls `on_interrupt`, all in the
caller's event-loop step, so a pipeline that interrupts on the audio chunk where the user
starts to speak has stopped every stage before the next chunk arrives.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any

from tristream.core.metrics import DropCounter, LatencyHistogram
from tristream.pipeline.inbox import Inbox, OverflowPolicy

log = logging.getLogger(__name__)


class ControlPacket:
    """Base of packets that travel in the control lane, ahead of data."""

    __slots__ = ()


@dataclass(slots=True, frozen=True)
class EndOfStream(ControlPacket):
    """Stop the stage after it has handled the control packet; queued data is dropped (counted)."""

    reason: str = "end_of_stream"


@dataclass(slots=True)
class Flush:
    """A data-lane marker: the tail stage resolves `done` after every packet queued before it."""

    done: asyncio.Future[None]


class StageLifecycleError(RuntimeError):
    """A stage was used in a way its life cycle does not allow (e.g. started twice)."""


class Stage:
    """One pipeline stage: override `process` (sync or async) and call `emit` for outputs.

    Hooks: `on_start`, `on_interrupt` (sync, must be quick), `on_control` for custom control
    packets, `on_end`. Exceptions from `process` are counted under `errors` and logged; the
    stage goes on with the next packet.
    """

    def __init__(
        self,
        name: str | None = None,
        capacity: int = 64,
        policy: OverflowPolicy = OverflowPolicy.BLOCK,
    ) -> None:
        self.name = name or type(self).__name__
        self.inbox = Inbox(self.name, capacity, policy)
        self.downstream: list[Inbox] = []
        self.timing = LatencyHistogram()
        self.errors = DropCounter(f"{self.name}.errors")
        self.handled = 0
        self.interrupts = 0
        self.task: asyncio.Task[None] | None = None
        self.is_tail = False
        self._busy = False
        self._interrupting = False
        self._process_is_async = inspect.iscoroutinefunction(self.process)
        self._blocking: list[Inbox] = []
        self._waiting = False

    # ---- wiring -----------------------------------------------------------------------
    def link(self, other: Stage | Inbox) -> None:
        """Send this stage's output to `other` (a stage or a bare inbox)."""
        self.downstream.append(other.inbox if isinstance(other, Stage) else other)

    def emit(self, item: Any) -> None:
        """Send one data packet to every downstream inbox (never awaits). A synchronous
        downstream stage that waits with empty lanes and room downstream handles it at once,
        in this call (`_take_inline`): a chain of such stages costs one event-loop wake-up,
        not one per stage, and the order of packets is the same."""
        for d in self.downstream:
            st = d.consumer
            if st is not None and st._take_inline(item):
                continue
            d.put_data(item)

    def _take_inline(self, item: Any) -> bool:
        """Handle `item` now if this stage is idle, both lanes are empty and no blocking
        downstream inbox is full (backpressure holds); False: queue it instead."""
        inbox = self.inbox
        if inbox.data or inbox.control or inbox.closed:
            return False
        for d in self._blocking:
            if len(d.data) >= d.capacity:
                return False
        inbox.consumer = None  # not re-entered while it runs
        t0 = time.perf_counter_ns()
        try:
            self.process(item)
        except Exception as exc:  # counted as the stage's own error, as in its run loop
            self.errors.add(type(exc).__name__)
            log.exception("stage %s: %s while handling a packet", self.name, type(exc).__name__)
        finally:
            if not inbox.closed and self._waiting:
                inbox.consumer = self
        self.timing.record(time.perf_counter_ns() - t0)
        self.handled += 1
        return True

    def emit_control(self, item: ControlPacket) -> None:
        """Send one control packet downstream, ahead of queued data."""
        for d in self.downstream:
            d.put_control(item)

    # ---- hooks ------------------------------------------------------------------------
    def process(self, item: Any) -> Any:
        """Handle one data packet (override; default passes it through)."""
        self.emit(item)

    async def on_start(self) -> None:
        """Called in the stage's task before the first packet."""

    def on_interrupt(self, reason: str) -> None:
        """Reset per-answer state after an interruption (sync, quick)."""

    async def on_control(self, item: ControlPacket) -> None:
        """Handle a custom control packet; default forwards it downstream."""
        self.emit_control(item)

    async def on_end(self) -> None:
        """Called once when the stage stops (after end of stream or cancellation)."""

    # ---- life cycle -------------------------------------------------------------------
    def start(self) -> asyncio.Task[None]:
        """Start the stage's task on the running loop."""
        if self.task is not None:
            raise StageLifecycleError(f"stage {self.name!r} is already started")
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"stage:{self.name}")
        return self.task

    def interrupt(self, reason: str = "interrupted") -> int:
        """Drop queued data, cancel the packet in flight and reset; returns packets dropped."""
        self.interrupts += 1
        self._cancel_flushes()
        dropped = self.inbox.clear_data(reason)
        if self._busy and self.task is not None and not self._interrupting:
            self._interrupting = True
            self.task.cancel(msg=reason)
            self.inbox.drops.add(f"{reason}_in_flight")
            dropped += 1
        self.on_interrupt(reason)
        return dropped

    async def stop(self) -> None:
        """Ask the stage to end (control lane) and wait for its task."""
        if self.task is None:
            return
        self.inbox.put_control(EndOfStream("stop"))
        await self.join()

    async def join(self) -> None:
        """Wait for the stage's task to end (a cancelled task has ended too); at once if unstarted."""
        if self.task is None:
            return
        try:
            await self.task
        except asyncio.CancelledError:
            pass

    def _cancel_flushes(self) -> None:
        for x in self.inbox.data:
            if type(x) is Flush and not x.done.done():
                x.done.set_result(None)

    @property
    def busy(self) -> bool:
        """Whether the stage is handling an item right now."""
        return self._busy

    def stats(self) -> dict[str, Any]:
        """Counters and timing of this stage (µs), for reports and metrics export."""
        return {
            "name": self.name,
            "handled": self.handled,
            "interrupts": self.interrupts,
            "queued": len(self.inbox.data),
            "high_water": self.inbox.high_water,
            "capacity": self.inbox.capacity,
            "drops": self.inbox.drops.snapshot(),
            "errors": self.errors.snapshot(),
            "process_ms": self.timing.summary_ms(),
        }

    async def _run(self) -> None:
        inbox = self.inbox
        data = inbox.data
        control = inbox.control
        proc = self.process
        is_async = self._process_is_async
        record = self.timing.record
        perf = time.perf_counter_ns
        blocking = self._blocking = [d for d in self.downstream if d.policy is OverflowPolicy.BLOCK]
        create_future = asyncio.get_running_loop().create_future
        try:
            await self.on_start()
            while True:
                try:
                    if control:
                        c = control.popleft()
                        if isinstance(c, EndOfStream):
                            inbox.close()
                            self._cancel_flushes()
                            inbox.clear_data(c.reason)
                            self.emit_control(c)
                            return
                        await self.on_control(c)
                        continue
                    if not data:
                        # inline wait (no coroutine per wait): one future, woken by put_*
                        fut = create_future()
                        inbox._waiter = fut
                        if not is_async:  # packets may be handed over inline meanwhile
                            self._waiting = True
                            inbox.consumer = self
                        try:
                            await fut
                        finally:
                            self._waiting = False
                            inbox.consumer = None
                        continue
                    item = data.popleft()
                    if inbox._space_waiters:
                        inbox.notify_space()
                    if type(item) is Flush:
                        if self.is_tail:
                            if not item.done.done():
                                item.done.set_result(None)
                        else:
                            for d in self.downstream:
                                d.put_marker(item)
                        continue
                    t0 = perf()
                    if is_async:
                        self._busy = True
                        try:
                            await proc(item)
                        finally:
                            self._busy = False
                    else:
                        proc(item)
                    record(perf() - t0)
                    self.handled += 1
                    for d in blocking:
                        if len(d.data) >= d.capacity:
                            await d.wait_space()
                except asyncio.CancelledError:
                    if self._interrupting:
                        self._interrupting = False
                        task = asyncio.current_task()
                        if task is not None:
                            task.uncancel()
                        continue
                    raise
                except Exception as exc:  # a bad packet must not kill the session
                    self.errors.add(type(exc).__name__)
                    log.exception("stage %s: %s while handling a packet", self.name, type(exc).__name__)
        finally:
            inbox.close()
            await self.on_end()
