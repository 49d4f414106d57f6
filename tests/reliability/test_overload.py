"""Issue 9 items 1-2 (fast form): overload at 2x capacity, exact queue rejections, deadlines.

Scheduler level on the simulator's virtual clock (`tests/reliability/sched_load.py`), and
server level on loopback: with ``max_sessions`` N and N+k clients, exactly k are refused
with a clear HTTP 503 quickly; a shed (rate-limited) message is answered with a coded error.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.reliability.sched_load import capacity_sessions, overload_run
from tests.serve.helpers import TOKEN, run, running_server, url
from tristream.sched.admission import QueuePolicy, ShedReason
from tristream.sched.config import ours_config
from tristream.sched.scheduler import Scheduler
from tristream.sched.session import WorkShape
from tristream.sched.types import Kind, Tier

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def overload() -> object:
    cap = capacity_sessions(lo=80, step=80, duration_s=6.0)
    return cap, overload_run(2 * cap, duration_s=12.0)


def test_overload_at_twice_capacity_gold_holds_and_every_shed_turn_is_answered(overload: object) -> None:
    cap, r = overload  # type: ignore[misc]
    assert r.sessions == 2 * cap and r.steps > 0  # ran to the end: 0 crashes
    gold = r.summary[Tier.GOLD]
    assert gold.turns > 0 and gold.shed == 0 and gold.p99_ms <= gold.target_ms
    assert r.ledger, "2x capacity must shed something (otherwise capacity was underestimated)"
    assert r.unanswered == 0  # every turn got a first token or a shed reason
    for reason, delays in r.shed_delays_ms.items():
        assert all(d <= 100.0 for d in delays), (reason, max(delays))


def test_deadlines_nothing_served_late_and_late_turns_say_timeout(overload: object) -> None:
    _, r = overload  # type: ignore[misc]
    assert r.late_served == 0, r.served_after_deadline_ms[:5]
    # a deadline tight enough to bite: every turn is served in time or rejected with `timeout`
    pol = QueuePolicy(timeouts_ms={Kind.TURN_END: 5.0})
    s = Scheduler(ours_config(queue={t: pol for t in Tier}, shape=WorkShape(vision_fps=0.0)))
    for sid in range(40):
        s.open_session(sid, Tier.BRONZE, 0, camera_fps=0.0)
        s.text_message(sid, 0, tokens=30, answer_tokens=4)
    now = 0
    from tristream.sched.backend import StepResult

    while s.items and now < 2_000_000_000:
        plan = s.plan(now)
        now += 3_000_000
        s.complete(plan, StepResult(3_000_000), now)
    assert len(s.turns) == 40
    late = [t for t in s.turns if math.isfinite(t.latency_ms) and t.latency_ms > 5.0 + 3.0]
    assert not late  # a turn may finish within the step that started before its deadline, never after
    shed = [t for t in s.turns if not math.isfinite(t.latency_ms)]
    assert shed and all(t.shed is ShedReason.TIMEOUT for t in shed)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(0, 40))
def test_queue_size_n_with_n_plus_k_submitted_rejects_exactly_k(n: int, k: int) -> None:
    q = {t: QueuePolicy(max_queue_size=n) for t in Tier}
    s = Scheduler(ours_config(queue=q, shape=WorkShape(vision_fps=0.0)))
    for sid in range(n + k):
        s.open_session(sid, Tier.SILVER, 0, camera_fps=0.0)
        s.text_message(sid, 0, tokens=10, answer_tokens=5)
    assert s.ledger.total(ShedReason.QUEUE_FULL) == k
    assert sum(1 for t in s.turns if t.shed is ShedReason.QUEUE_FULL) == k
    assert len(s.items) == n


def test_server_max_sessions_n_plus_k_refuses_exactly_k_quickly() -> None:
    n, k = 12, 7
    from tristream.serve.limits import ServerLimits

    async def go() -> None:
        async with running_server(limits=ServerLimits(max_sessions=n)) as srv:
            held = []
            for _ in range(n):
                ws = await connect(url(srv), additional_headers=AUTH)
                assert json.loads(await ws.recv())["type"] == "session.created"
                held.append(ws)

            async def extra() -> tuple[int, float, str]:
                t0 = time.perf_counter()
                try:
                    async with connect(url(srv), additional_headers=AUTH):
                        return 101, time.perf_counter() - t0, ""
                except InvalidStatus as e:
                    r = e.response
                    return r.status_code, time.perf_counter() - t0, r.headers.get("Retry-After", "")

            outs = await asyncio.gather(*(extra() for _ in range(k)))
            assert [o[0] for o in outs] == [503] * k
            assert all(o[2] for o in outs)  # a clear refusal: Retry-After
            assert max(o[1] for o in outs) < 0.5  # answered at once (loose bound for a loaded CI box)
            assert srv.metrics.count("tristream_connections_refused_total", reason="max_sessions") == k
            for ws in held:
                await ws.close()
    run(go())


def test_shed_message_gets_a_coded_error_fast() -> None:
    from tristream.serve.limits import ServerLimits

    lim = ServerLimits(max_messages_per_s=5.0, burst_messages=5.0)

    async def go() -> None:
        async with running_server(limits=lim) as srv:
            async with connect(url(srv), additional_headers=AUTH) as ws:
                await ws.recv()
                delays = []
                for i in range(20):
                    t0 = time.perf_counter()
                    await ws.send(json.dumps({"type": "input_audio_buffer.clear", "event_id": f"e{i}"}))
                    ev = json.loads(await asyncio.wait_for(ws.recv(), 5))
                    if ev["type"] == "error":
                        assert ev["error"]["code"] == "rate_limit_exceeded" and ev["error"]["message"]
                        delays.append(time.perf_counter() - t0)
                assert len(delays) >= 14
                assert max(delays) < 0.1
    run(go())
