"""Clocks the session paces itself by: the monotonic clock live, a virtual one in tests.

Audio in and audio out are paced by the same clock, so a test that advances a
`VirtualClock` by one input chunk also lets exactly one output chunk play: barge-in and
backpressure tests need no sleeps and no wall-time assumptions.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    """Reference-clock time in ns, and a way to wait for a point in it."""

    def now_ns(self) -> int: ...

    async def sleep_until(self, t_ns: int) -> None: ...


class MonotonicClock:
    """`time.monotonic_ns` and `asyncio.sleep`: real time."""

    def now_ns(self) -> int:
        """Current monotonic time (ns)."""
        return time.monotonic_ns()

    async def sleep_until(self, t_ns: int) -> None:
        """Sleep until monotonic time `t_ns` (returns at once if it has passed)."""
        dt = t_ns - time.monotonic_ns()
        if dt > 0:
            await asyncio.sleep(dt / 1e9)


class VirtualClock:
    """Time that moves only when `advance` is called; sleepers wake in deadline order."""

    def __init__(self, start_ns: int = 0) -> None:
        self._now = start_ns
        self._sleepers: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now_ns(self) -> int:
        """Current virtual time (ns)."""
        return self._now

    async def sleep_until(self, t_ns: int) -> None:
        """Wait until virtual time reaches `t_ns`."""
        if t_ns <= self._now:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (t_ns, next(self._seq), fut))
        await fut

    def advance(self, dt_ns: int) -> None:
        """Move time forward by `dt_ns` and wake every sleeper whose deadline has passed."""
        if dt_ns < 0:
            raise ValueError(f"a clock cannot go back ({dt_ns} ns)")
        self._now += dt_ns
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)
