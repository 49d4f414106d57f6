"""A linear chain of stages with a head to push into and a tail inbox to read from."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

from tristream.pipeline.inbox import Inbox, OverflowPolicy
from tristream.pipeline.stage import EndOfStream, Flush, Stage, StageLifecycleError


class Pipeline:
    """Stages linked head to tail; the tail's output lands in `self.out` (a bounded inbox).

    `push` applies the head's overflow policy (waits for space under BLOCK), `interrupt`
    stops every stage in the same event-loop step, `drain` waits until everything pushed
    so far has reached the tail.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        out_capacity: int = 1024,
        out_policy: OverflowPolicy = OverflowPolicy.BLOCK,
    ) -> None:
        if not stages:
            raise StageLifecycleError("a pipeline needs at least one stage")
        self.stages = list(stages)
        self.out = Inbox("pipeline_out", out_capacity, out_policy)
        for a, b in itertools.pairwise(self.stages):
            a.link(b)
        self.stages[-1].link(self.out)
        self.stages[-1].is_tail = True
        self._started = False

    @property
    def head(self) -> Inbox:
        """The first stage's inbox."""
        return self.stages[0].inbox

    def start(self) -> None:
        """Start one task per stage on the running loop."""
        if self._started:
            raise StageLifecycleError("pipeline already started")
        self._started = True
        for s in self.stages:
            s.start()

    async def push(self, item: Any) -> bool:
        """Put one data packet at the head; False when the head's policy dropped it."""
        head = self.stages[0].inbox
        ok = head.put_data(item)
        if head.policy is OverflowPolicy.BLOCK and len(head.data) >= head.capacity:
            await head.wait_space()
        return ok

    def push_nowait(self, item: Any) -> bool:
        """Put one data packet at the head without waiting (the caller owns backpressure)."""
        return self.stages[0].inbox.put_data(item)

    async def get(self) -> Any:
        """Take the next packet from the tail (waits for one)."""
        out = self.out
        while not out.data:
            if out.control:
                return out.control.popleft()
            await out.wait_item()
        item = out.data.popleft()
        if out._space_waiters:
            out.notify_space()
        return item

    def interrupt(self, reason: str = "interrupted") -> int:
        """Interrupt every stage now and drop queued tail output; returns packets dropped."""
        n = 0
        for s in self.stages:
            n += s.interrupt(reason)
        n += self.out.clear_data(reason)
        return n

    async def drain(self) -> None:
        """Wait until every packet pushed before this call has left the tail stage.

        Returns early, without error, if an interruption dropped the marker.
        """
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        head = self.stages[0].inbox
        head.put_marker(Flush(fut))
        await fut

    async def stop(self) -> None:
        """End every stage (control lane first) and wait for their tasks."""
        head = self.stages[0]
        if head.task is None:
            return
        head.inbox.put_control(EndOfStream("stop"))
        for s in self.stages:
            await s.join()

    def stats(self) -> list[dict[str, Any]]:
        """Per-stage counters and timing."""
        return [s.stats() for s in self.stages]
