"""The clocks: one protocol, real time (`MonotonicClock`, `WallClock`) and virtual time (`VirtualClock`).

Everything that paces itself or stamps events takes a clock: the scheduler's driving loop
(`advance_to`: wait, or jump in a simulation), a session's stages (`sleep_until` on the event
loop: playout is paced by the same clock as the input, so a test that advances a
`VirtualClock` by one input chunk lets exactly one output chunk play) and the server's
session (a zero-argument callable giving ns: ``clock()``). A `VirtualClock` serves all
three, so tests and replays need no sleeps and no wall-time assumptions.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    """Reference-clock time in ns, and two ways to wait for a point in it."""

    def now_ns(self) -> int:
        """Current time (ns)."""
        ...

    def advance_to(self, t_ns: int) -> None:
        """Block until `t_ns` (a virtual clock jumps there)."""
        ...

    async def sleep_until(self, t_ns: int) -> None:
        """Wait on the event loop until `t_ns`."""
        ...


class MonotonicClock:
    """`time.monotonic_ns`: real time."""

    def now_ns(self) -> int:
        """Current monotonic time (ns)."""
        return time.monotonic_ns()

    def __call__(self) -> int:
        return self.now_ns()

    def advance_to(self, t_ns: int) -> None:
        """Sleep the thread until `t_ns`."""
        dt = t_ns - self.now_ns()
        if dt > 0:
            time.sleep(dt / 1e9)

    async def sleep_until(self, t_ns: int) -> None:
        """Sleep on the loop until `t_ns` (returns at once if it has passed)."""
        dt = t_ns - self.now_ns()
        if dt > 0:
            await asyncio.sleep(dt / 1e9)


class WallClock(MonotonicClock):
    """Real time counted from the clock's creation (the scheduler's traces start at 0)."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter_ns()

    def now_ns(self) -> int:
        """Nanoseconds since construction."""
        return time.perf_counter_ns() - self._t0


class VirtualClock:
    """Time that moves only when told to (`advance`, `advance_to`); loop sleepers wake in deadline order."""

    def __init__(self, start_ns: int = 0) -> None:
        self._now = start_ns
        self._sleepers: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now_ns(self) -> int:
        """Current virtual time (ns)."""
        return self._now

    def __call__(self) -> int:
        return self._now

    @property
    def sleepers(self) -> int:
        """Tasks waiting in `sleep_until`."""
        return len(self._sleepers)

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
        self.advance_to(self._now + dt_ns)

    def advance_to(self, t_ns: int) -> None:
        """Jump forward to `t_ns` (never back) and wake the sleepers due by then."""
        if t_ns > self._now:
            self._now = t_ns
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)
