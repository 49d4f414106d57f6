"""Stage runtime: ordering, control lane, backpressure, drops with reasons, interruption."""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.pipeline.inbox import Inbox, OverflowPolicy
from tristream.pipeline.pipeline import Pipeline
from tristream.pipeline.stage import ControlPacket, Stage, StageLifecycleError


class Gate(Stage):
    """An async stage that holds each packet until the test opens the gate."""

    def __init__(self, name: str = "gate", **kw: Any) -> None:
        super().__init__(name, **kw)
        self.open = asyncio.Event()
        self.seen: list[Any] = []
        self.entered = asyncio.Event()
        self.interrupted: list[str] = []

    async def process(self, item: Any) -> None:
        self.entered.set()
        await self.open.wait()
        self.seen.append(item)
        self.emit(item)

    def on_interrupt(self, reason: str) -> None:
        self.interrupted.append(reason)


class Mark(ControlPacket):
    __slots__ = ("tag",)

    def __init__(self, tag: str) -> None:
        self.tag = tag


class Recorder(Stage):
    def __init__(self) -> None:
        super().__init__("rec")
        self.log: list[Any] = []

    def process(self, item: Any) -> None:
        self.log.append(item)
        self.emit(item)

    async def on_control(self, item: ControlPacket) -> None:
        assert isinstance(item, Mark)
        self.log.append(("ctrl", item.tag))


async def _collect(p: Pipeline, n: int) -> list[Any]:
    return [await p.get() for _ in range(n)]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(), max_size=200), st.integers(min_value=1, max_value=8))
def test_order_preserved_through_pass_through_stages(items: list[int], cap: int) -> None:
    async def main() -> list[Any]:
        p = Pipeline([Stage(f"s{i}", capacity=cap) for i in range(5)])
        p.start()
        reader = asyncio.ensure_future(_collect(p, len(items)))
        for x in items:
            await p.push(x)
        out = await reader
        await p.stop()
        return out

    assert asyncio.run(main()) == items


def test_control_lane_jumps_queued_data() -> None:
    async def main() -> list[Any]:
        rec = Recorder()
        p = Pipeline([rec])
        p.start()
        await asyncio.sleep(0)  # the recorder waits for its first packet
        for i in range(5):
            rec.inbox.put_data(i)  # queued: only a stage's `emit` hands packets over inline
        rec.inbox.put_control(Mark("urgent"))
        await p.drain()
        await p.stop()
        return rec.log

    assert asyncio.run(main()) == [("ctrl", "urgent"), 0, 1, 2, 3, 4]


def test_a_chain_of_synchronous_stages_hands_packets_over_inline_in_order() -> None:
    """Behind an async stage, idle synchronous stages take each packet in the emitting call
    (no wake-up per stage); a busy or backed-up one queues it, and the order holds."""

    at_emit: list[Any] = []

    class Watched(Gate):
        def emit(self, item: Any) -> None:
            super().emit(item)
            at_emit.append(rec.log[-1] if rec.log else None)  # where the packet is when emit returns

    async def main() -> tuple[list[Any], list[int]]:
        gate = Watched()
        p = Pipeline([gate, Stage("b"), Stage("c"), rec])
        p.start()
        for i in range(20):
            p.push_nowait(i)
        await gate.entered.wait()
        gate.open.set()
        out = [await p.get() for _ in range(20)]
        await p.stop()
        return out, [p.stages[1].handled, p.stages[2].handled, rec.handled]

    rec = Recorder()
    out, handled = asyncio.run(main())
    assert out == list(range(20))
    assert handled == [20, 20, 20]
    assert at_emit == list(range(20))  # each packet was through b and c when the gate's emit returned


def test_blocking_backpressure_bounds_queues_and_loses_nothing() -> None:
    cap = 4

    async def main() -> tuple[list[Any], list[int], int]:
        slow = Gate("slow", capacity=cap)
        p = Pipeline([Stage("a", capacity=cap), slow, Stage("c", capacity=cap)], out_capacity=cap)
        p.start()
        produced = 0

        async def producer() -> None:
            nonlocal produced
            for i in range(500):
                await p.push(i)
                produced += 1

        prod = asyncio.ensure_future(producer())
        for _ in range(50):
            await asyncio.sleep(0)
        # The slow stage holds one packet: the producer must be stuck, not queueing 500.
        stuck_at = produced
        slow.open.set()
        out = await _collect(p, 500)
        await prod
        highs = [s.inbox.high_water for s in p.stages] + [p.out.high_water]
        await p.stop()
        return out, highs, stuck_at

    out, highs, stuck_at = asyncio.run(main())
    assert out == list(range(500))
    assert stuck_at < 4 * (cap + 1) + 2
    assert max(highs) <= cap + 1


@pytest.mark.parametrize(
    ("policy", "reason"),
    [(OverflowPolicy.DROP_OLDEST, "inbox_full_drop_oldest"), (OverflowPolicy.DROP_NEWEST, "inbox_full_drop_newest")],
)
def test_dropping_policy_counts_every_drop(policy: OverflowPolicy, reason: str) -> None:
    async def main() -> tuple[list[Any], dict[str, int]]:
        slow = Gate("slow", capacity=8, policy=policy)
        p = Pipeline([slow])
        p.start()
        for i in range(100):
            await p.push(i)
        await slow.entered.wait()
        for i in range(100, 200):
            await p.push(i)
        slow.open.set()
        await p.drain()
        got: list[Any] = []
        while p.out.data:
            got.append(await p.get())
        drops = slow.inbox.drops.snapshot()
        await p.stop()
        return got, drops

    got, drops = asyncio.run(main())
    assert set(drops) == {reason}
    assert len(got) + drops[reason] == 200
    assert len(got) <= 8 + 1
    if policy is OverflowPolicy.DROP_OLDEST:
        assert got[-1] == 199
    else:
        assert got[:2] == [0, 1]


def test_slow_stage_memory_stays_bounded_under_live_source() -> None:
    """A live source pushing 20 ms chunks into a stalled stage: memory stays flat, drops counted."""

    async def main() -> tuple[int, int, int]:
        slow = Gate("slow", capacity=16, policy=OverflowPolicy.DROP_OLDEST)
        p = Pipeline([slow])
        p.start()
        chunk = np.zeros(320, dtype=np.float32)
        tracemalloc.start()
        for _ in range(200):
            p.push_nowait(chunk.copy())
        await slow.entered.wait()
        base, _ = tracemalloc.get_traced_memory()
        for _ in range(5000):
            p.push_nowait(chunk.copy())
        now, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        drops = slow.inbox.drops["inbox_full_drop_oldest"]
        slow.open.set()
        await p.stop()
        return base, now, drops

    base, now, drops = asyncio.run(main())
    assert drops == 5200 - 16 - 1  # one packet is in flight in the stage, 16 queued
    assert now - base < 64 * 1024  # 5000 more chunks (6.4 MB) did not accumulate


def test_interrupt_cancels_in_flight_and_drops_queued_then_recovers() -> None:
    async def main() -> tuple[Gate, list[Any], int]:
        gate = Gate()
        p = Pipeline([gate, Stage("after")])
        p.start()
        for i in range(10):
            p.push_nowait(i)
        await gate.entered.wait()
        dropped = p.interrupt("barge_in")
        # Synchronous: the in-flight handler is cancelled and queues are empty in this same step.
        assert len(gate.inbox.data) == 0
        gate.entered.clear()
        gate.open.set()
        await p.push("after-interrupt")
        out = [await p.get()]
        await p.stop()
        return gate, out, dropped

    gate, out, dropped = asyncio.run(main())
    assert out == ["after-interrupt"]
    assert gate.seen == ["after-interrupt"]
    assert gate.interrupted == ["barge_in"]
    assert dropped == 10
    assert gate.inbox.drops.snapshot() == {"barge_in": 9, "barge_in_in_flight": 1}


def test_process_error_is_counted_and_stage_goes_on() -> None:
    class Fussy(Stage):
        def process(self, item: Any) -> None:
            if item == 3:
                raise ValueError("bad packet")
            self.emit(item)

    async def main() -> tuple[list[Any], dict[str, int]]:
        s = Fussy()
        p = Pipeline([s])
        p.start()
        for i in range(6):
            await p.push(i)
        await p.drain()
        got = [p.out.data.popleft() for _ in range(len(p.out.data))]
        await p.stop()
        return got, s.errors.snapshot()

    got, errors = asyncio.run(main())
    assert got == [0, 1, 2, 4, 5]
    assert errors == {"ValueError": 1}


def test_stage_timing_and_stats() -> None:
    async def main() -> dict[str, Any]:
        p = Pipeline([Stage("x")])
        p.start()
        for i in range(100):
            await p.push(i)
        await p.drain()
        st_ = p.stats()[0]
        await p.stop()
        return st_

    s = asyncio.run(main())
    assert s["handled"] == 100
    assert s["process_ms"]["count"] == 100.0
    assert 0 < s["process_ms"]["p50"] < 1.0


def test_life_cycle_errors_are_specific() -> None:
    with pytest.raises(StageLifecycleError, match="at least one stage"):
        Pipeline([])
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        Inbox("x", capacity=0)

    async def main() -> None:
        s = Stage("twice")
        s.start()
        with pytest.raises(StageLifecycleError, match="already started"):
            s.start()
        await s.stop()
        assert s.inbox.put_data(1) is False
        assert s.inbox.drops["inbox_closed"] == 1

    asyncio.run(main())
