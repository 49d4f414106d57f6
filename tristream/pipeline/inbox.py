"""Bounded two-lane inbox of a pipeline stage.

Control packets (interruption, end of stream) go to an unbounded control lane that the
stage always reads first; data packets go to a bounded data lane in order. The inbox is a
pair of deques and at most one waiter future: no `asyncio.Queue`, no lock, no per-packet
task, which keeps a hop between stages to one event-loop wake-up.
"""

from __future__ import annotations

import asyncio
from collections import deque
from enum import Enum
from typing import Any

from tristream.core.metrics import DropCounter


class OverflowPolicy(Enum):
    """What a full data lane does with the next packet."""

    BLOCK = "block"
    """Accept it and make the producer wait for space before its next packet (backpressure)."""
    DROP_OLDEST = "drop_oldest"
    """Drop the oldest queued packet (live sources: fresher data wins); counted."""
    DROP_NEWEST = "drop_newest"
    """Refuse the new packet; counted."""


class InboxClosed(RuntimeError):
    """A packet was put into the inbox of a stage that has already ended."""


class Inbox:
    """Two-lane inbox: unbounded control lane first, bounded data lane in order.

    `put_data` never awaits. Under `OverflowPolicy.BLOCK` a full lane still accepts the
    packet, and the producer must `await wait_space()` before producing again; a stage's run
    loop does that after each packet it handles, so a lane holds at most `capacity` plus the
    packets one handler call emits.
    """

    __slots__ = (
        "name",
        "capacity",
        "policy",
        "data",
        "control",
        "drops",
        "high_water",
        "closed",
        "_waiter",
        "_space_waiters",
        "consumer",
    )

    def __init__(self, name: str, capacity: int = 64, policy: OverflowPolicy = OverflowPolicy.BLOCK) -> None:
        if capacity < 1:
            raise ValueError(f"inbox {name!r}: capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self.data: deque[Any] = deque()
        self.control: deque[Any] = deque()
        self.drops = DropCounter(f"{name}.drops")
        self.high_water = 0
        self.closed = False
        self._waiter: asyncio.Future[None] | None = None
        self._space_waiters: list[asyncio.Future[None]] = []
        self.consumer: Any = None
        """The stage reading this inbox while it may take a packet inline (a synchronous
        stage waiting with both lanes empty, see `Stage.emit`); None otherwise."""

    def __len__(self) -> int:
        return len(self.data) + len(self.control)

    def put_data(self, item: Any) -> bool:
        """Queue a data packet; returns False when the policy dropped it (counted)."""
        if self.closed:
            self.drops.add("inbox_closed")
            return False
        data = self.data
        n = len(data)
        if n >= self.capacity:
            policy = self.policy
            if policy is OverflowPolicy.DROP_NEWEST:
                self.drops.add("inbox_full_drop_newest")
                return False
            if policy is OverflowPolicy.DROP_OLDEST:
                data.popleft()
                self.drops.add("inbox_full_drop_oldest")
                n -= 1
        data.append(item)
        if n >= self.high_water:
            self.high_water = n + 1
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)
        return True

    def put_marker(self, item: Any) -> None:
        """Queue an in-order marker (flush) that no overflow policy may drop."""
        self.data.append(item)
        self._wake()

    def put_control(self, item: Any) -> None:
        """Queue a control packet ahead of every data packet."""
        self.control.append(item)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def wait_item(self) -> None:
        """Wait until either lane holds a packet."""
        while not self.data and not self.control:
            fut = asyncio.get_running_loop().create_future()
            self._waiter = fut
            await fut

    def has_space(self) -> bool:
        """Whether the data lane is below capacity."""
        return len(self.data) < self.capacity

    async def wait_space(self) -> None:
        """Wait until the data lane is below capacity (used by blocking producers)."""
        while len(self.data) >= self.capacity and not self.closed:
            fut = asyncio.get_running_loop().create_future()
            self._space_waiters.append(fut)
            await fut

    def notify_space(self) -> None:
        """Wake blocked producers; the consumer calls this after taking packets."""
        if self._space_waiters and len(self.data) < self.capacity:
            waiters, self._space_waiters = self._space_waiters, []
            for f in waiters:
                if not f.done():
                    f.set_result(None)

    def clear_data(self, reason: str) -> int:
        """Drop every queued data packet, counted under `reason`; returns how many."""
        n = len(self.data)
        if n:
            self.data.clear()
            self.drops.add(reason, n)
        self.notify_space()
        return n

    def close(self) -> None:
        """Refuse further data packets and release anyone waiting for space."""
        self.closed = True
        waiters, self._space_waiters = self._space_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)
        self._wake()
