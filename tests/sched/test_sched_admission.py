from __future__ import annotations

import math

import pytest

from tristream.sched.admission import (
    DegradationLadder,
    LadderConfig,
    Level,
    QueuePolicy,
    ShedReason,
    TimeoutAction,
)
from tristream.sched.backend import StepResult
from tristream.sched.config import ours_config, static_priority_config
from tristream.sched.scheduler import Scheduler
from tristream.sched.session import WorkShape
from tristream.sched.types import MS, Kind, SessionRefused, Tier

S = 1_000_000_000


def test_ladder_escalates_in_order_and_relaxes_one_level_at_a_time() -> None:
    lad = DegradationLadder(LadderConfig(escalate_after_ms=100, relax_after_ms=500))
    seen = []
    t = 0
    while lad.level < Level.REFUSE_NEW_SESSIONS:
        t += 10 * MS
        lad.update(t, 2.0)
        if not seen or seen[-1] != lad.level:
            seen.append(lad.level)
    assert seen == [Level.NORMAL, Level.DROP_STALE_VIDEO, Level.LOWER_VISION_RATE,
                    Level.SHORTEN_ANSWERS, Level.REFUSE_NEW_SESSIONS]
    lad.update(t + 10 * MS, 0.8)  # in the hysteresis band: hold
    assert lad.level is Level.REFUSE_NEW_SESSIONS
    t += 20 * MS
    lad.update(t, 0.1)
    lad.update(t + 499 * MS, 0.1)
    assert lad.level is Level.REFUSE_NEW_SESSIONS
    lad.update(t + 500 * MS, 0.1)
    assert lad.level is Level.SHORTEN_ANSWERS


def _sched(level: Level, **shape: float) -> Scheduler:
    cfg = ours_config(shape=WorkShape(**shape)) if shape else ours_config()
    s = Scheduler(cfg)
    s.ladder.level = level
    s.ladder.update = lambda *a: s.ladder.level  # type: ignore[method-assign]  # pin the level
    return s


def _queued(s: Scheduler, sid: int, kind: Kind) -> list:
    return [it for it in s.items.values() if it.session_id == sid and it.kind is kind]


def test_level1_drops_stale_video_keeping_the_newest() -> None:
    for level, expect_frames in ((Level.NORMAL, 3), (Level.DROP_STALE_VIDEO, 1)):
        s = _sched(level, vision_fps=10.0)
        s.open_session(1, Tier.BRONZE, 0)
        s.open_session(2, Tier.GOLD, 0)
        for k in range(3):
            s.plan(k * 100 * MS)  # fire the vision ticks; nothing is completed
        frames = _queued(s, 1, Kind.VISION_FRAME)
        assert len(frames) == expect_frames
        assert frames[-1].frame_index == 6  # 200 ms at 30 fps: the newest frame survives
        assert s.ledger.total(ShedReason.STALE_VIDEO, Tier.BRONZE) == 3 - expect_frames
        assert len(_queued(s, 2, Kind.VISION_FRAME)) == 3  # gold is exempt from the ladder
        assert s.ledger.events["frames_not_sampled"] == 2 * 2 * 2  # 2 sessions × 2 gaps × 2 frames


def test_level2_lowers_the_vision_rate_and_counts_it() -> None:
    s = _sched(Level.LOWER_VISION_RATE, vision_fps=4.0)
    s.open_session(1, Tier.SILVER, 0)
    made = 0
    for k in range(0, 2001, 5):
        now = k * MS
        before = set(s.items)
        plan = s.plan(now)
        made += sum(1 for i in s.items if i not in before and s.items[i].kind is Kind.VISION_FRAME)
        s.complete(plan, StepResult(1), now)
    # 4 fps × 0.25 = 1 fps: ticks at 0, 1, 2 s
    assert made == 3
    assert s.ledger.total(ShedReason.VISION_RATE, Tier.SILVER) == 6  # 3 normal ticks skipped per second


def test_level3_shortens_answers_level4_refuses_sessions() -> None:
    s = _sched(Level.SHORTEN_ANSWERS)
    s.open_session(1, Tier.BRONZE, 0)
    s.open_session(2, Tier.GOLD, 0)
    s.speech_start(1, 0)
    s.turn_end(1, S, tail_tokens=10, answer_tokens=80)
    s.speech_start(2, 0)
    s.turn_end(2, S, tail_tokens=10, answer_tokens=80)
    assert _queued(s, 1, Kind.TURN_END)[0].meta["answer"] == 24
    assert _queued(s, 2, Kind.TURN_END)[0].meta["answer"] == 80
    assert s.ledger.total(ShedReason.ANSWER_SHORTENED, Tier.BRONZE) == 56
    s.open_session(3, Tier.SILVER, S)  # level 3 still admits
    s.ladder.level = Level.REFUSE_NEW_SESSIONS
    with pytest.raises(SessionRefused, match="overloaded .* refusing new bronze sessions"):
        s.open_session(4, Tier.BRONZE, S)
    s.open_session(5, Tier.GOLD, S)
    assert s.ledger.total(ShedReason.SESSION_REFUSED) == 1


def test_queue_full_rejects_and_records_the_missed_turn() -> None:
    q = {t: QueuePolicy(max_queue_size=1) for t in Tier}
    s = Scheduler(ours_config(queue=q, shape=WorkShape(vision_fps=0.0)))
    s.open_session(1, Tier.SILVER, 0, camera_fps=0.0)
    s.text_message(1, 0, tokens=10, answer_tokens=5)
    s.open_session(2, Tier.SILVER, 0, camera_fps=0.0)
    s.text_message(2, 0, tokens=10, answer_tokens=5)
    assert s.ledger.total(ShedReason.QUEUE_FULL, Tier.SILVER, Kind.TURN_END) == 1
    assert [t.latency_ms for t in s.turns] == [math.inf]
    assert s.turns[0].shed is ShedReason.QUEUE_FULL


def test_timeouts_reject_or_delay() -> None:
    pol = QueuePolicy(timeouts_ms={Kind.TURN_END: 100.0, Kind.PREFILL: 100.0},
                      actions={Kind.PREFILL: TimeoutAction.DELAY})
    cfg = ours_config(queue={t: pol for t in Tier}, shape=WorkShape(vision_fps=0.0))
    s = Scheduler(cfg)
    s.open_session(1, Tier.BRONZE, 0, camera_fps=0.0)
    s.text_message(1, 0, tokens=10, answer_tokens=5)
    s.open_session(2, Tier.BRONZE, 0, camera_fps=0.0)
    s._add_prefill(s.sessions[2], 8, 0)
    s.plan(101 * MS)
    assert s.ledger.total(ShedReason.TIMEOUT, Tier.BRONZE, Kind.TURN_END) == 1
    assert s.turns[-1].shed is ShedReason.TIMEOUT
    pf = _queued(s, 2, Kind.PREFILL)
    assert len(pf) == 1 and pf[0].delayed
    assert s.ledger.events["delayed_by_timeout"] == 1


def _answering(s: Scheduler, sid: int, tier: Tier, now: int) -> int:
    """Open `sid`, send a typed turn and run steps until its answer is decoding."""
    s.open_session(sid, tier, now, camera_fps=0.0)
    s.text_message(sid, now, tokens=8, answer_tokens=50)
    while not _queued(s, sid, Kind.DECODE):
        plan = s.plan(now)
        now += 2 * MS
        s.complete(plan, StepResult(2 * MS), now)
    return now


@pytest.mark.parametrize("preset,preempted", [(ours_config, True), (static_priority_config, False)])
def test_gold_end_of_turn_preempts_bronze_decode(preset, preempted: bool) -> None:
    from tristream.sched.batcher import BatchLimits
    from tristream.sched.controller import AIMDConfig

    # the step budget pinned to its floor; no "free" items: any decode that lengthens the step
    # of a gold end of turn beyond the budget is left out of that step
    cfg = preset(limits=BatchLimits(min_prefill_chunk=1, free_ms=0.0), shape=WorkShape(vision_fps=0.0),
                 aimd=AIMDConfig(min_limit_ms=1.0, max_limit_ms=1.0))
    s = Scheduler(cfg)
    now = _answering(s, 1, Tier.BRONZE, 0)
    plan = s.plan(now)  # bronze decode runs this step
    assert [e.item.kind for e in plan.entries] == [Kind.DECODE]
    now += 2 * MS
    s.complete(plan, StepResult(2 * MS), now)
    s.open_session(2, Tier.GOLD, now, camera_fps=0.0)
    s.speech_start(2, now)
    s.turn_end(2, now + MS, tail_tokens=400, answer_tokens=5)  # long final prefill + final ASR
    plan = s.plan(now + MS)
    kinds = [(e.item.tier, e.item.kind) for e in plan.entries]
    if preempted:
        assert kinds == [(Tier.GOLD, Kind.TURN_END)]
        assert s.ledger.events["preempted_decode_bronze"] == 1
        assert plan.est_ms > s.budget_floor_ms
    else:
        assert kinds[0] == (Tier.BRONZE, Kind.DECODE)
        assert (Tier.GOLD, Kind.TURN_END) in kinds


def test_barge_in_cancels_the_running_answer() -> None:
    s = Scheduler(ours_config(shape=WorkShape(vision_fps=0.0)))
    now = _answering(s, 1, Tier.SILVER, 0)
    s.speech_start(1, now)
    assert not _queued(s, 1, Kind.DECODE)
    assert s.ledger.events["barge_in_cancelled_tokens"] == 49


def test_second_end_of_turn_merges_into_the_queued_one() -> None:
    s = Scheduler(ours_config(shape=WorkShape(vision_fps=0.0)))
    s.open_session(1, Tier.GOLD, 0, camera_fps=0.0)
    s.speech_start(1, 0)
    s.turn_end(1, 100 * MS, tail_tokens=10, answer_tokens=30)
    s.text_message(1, 120 * MS, tokens=7, answer_tokens=40)
    te = _queued(s, 1, Kind.TURN_END)
    assert len(te) == 1
    assert te[0].tokens == 17 and te[0].turn_end_ns == 120 * MS and te[0].meta["answer"] == 40
    assert s.ledger.events["turn_ends_merged"] == 1
