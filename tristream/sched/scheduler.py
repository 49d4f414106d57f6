"""The cross-session scheduler: turns session events into work items and plans engine steps.

Call order from the driving loop (sim.py or real.py), all at step boundaries:
`open_session / speech_start / turn_end / text_message / close_session` as events arrive,
then `plan(now)` → execute on a backend → `complete(plan, result, now)`.

The work of one spoken turn: streaming-ASR updates every `asr_interval_ms` while the user
speaks (speech), encoded camera frames at `vision_fps` (vision), incremental prefill of
partial text and vision tokens (text), then at the end of the turn one TURN_END item (final
ASR update + the remaining prompt) whose completion is the first answer token — response
latency is measured from the end of the turn to that moment — and one DECODE item per
further answer token, paced `decode_pace_ms` apart.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, replace

from tristream.sched.admission import DegradationLadder, Level, ShedLedger, ShedReason, TimeoutAction
from tristream.sched.backend import StepResult
from tristream.sched.batcher import Batcher, BatchPlan
from tristream.sched.config import SchedulerConfig
from tristream.sched.controller import TierControllers
from tristream.sched.policy import PriorityPolicy
from tristream.sched.session import AnswerState, SessionState
from tristream.sched.steptime import CalibratedStepTime, StepTimeModel
from tristream.sched.types import MS, Kind, SessionRefused, Tier, UnknownSession, WorkItem, WorkModality

_ASR, _VISION = 0, 1
VISION_LATENCY_KEEP = 1 << 20
"""Encoded frames whose latency a scheduler keeps per tier (the latest ones)."""


@dataclass(frozen=True, slots=True)
class ServedTurn:
    """Outcome of one user turn: latency to first token, or the reason it got none."""

    session_id: int
    tier: Tier
    modality: WorkModality
    turn_end_ns: int
    latency_ms: float
    """math.inf when the turn was shed."""
    shed: ShedReason | None = None


class Scheduler:
    """Cross-session, step-level scheduler (ours or a baseline, per `SchedulerConfig`)."""

    def __init__(self, config: SchedulerConfig, model: StepTimeModel | CalibratedStepTime | None = None) -> None:
        self.config = config
        self.model = model or StepTimeModel()
        self.policy = PriorityPolicy(config.policy)
        self.batcher = Batcher(self.model, config.limits)
        # Floor of the step budget: a step must be able to carry every kind of work at once
        # (their fixed costs), or throughput collapses exactly when the load is highest.
        self.budget_floor_ms = self._floor()
        aimd = config.aimd
        if aimd.min_limit_ms < self.budget_floor_ms:
            aimd = replace(aimd, min_limit_ms=self.budget_floor_ms,
                           max_limit_ms=max(aimd.max_limit_ms, self.budget_floor_ms))
        self.controllers = TierControllers(config.tiers, aimd)
        self.ladder = DegradationLadder(config.ladder)
        self.ledger = ShedLedger()
        self.items: dict[int, WorkItem] = {}
        self.sessions: dict[int, SessionState] = {}
        self.turns: list[ServedTurn] = []
        self.stats: Counter[str] = Counter()
        """`<tier>/decode_tokens`, `<tier>/decode_late` (after the pace deadline), `<tier>/frames_encoded`."""
        self.vision_latency_ms: dict[Tier, deque[float]] = {t: deque(maxlen=VISION_LATENCY_KEEP) for t in Tier}
        """Per tier: frame arrival → encoded, for the latest `VISION_LATENCY_KEEP` encoded frames
        (bounded: a server runs for days at 30 fps per session)."""
        self.queue_len: Counter[Tier] = Counter()
        self.open_tiers: Counter[Tier] = Counter()
        self.step_no = 0
        self._next_id = 0
        self._timers: list[tuple[int, int, int, int, int]] = []
        self._timer_seq = 0
        self._next_ctrl_ns = 0
        self._ring_ns = int(config.shape.ring_ms * MS)
        self._hash = hashlib.blake2b(digest_size=16)
        self._period_decode: Counter[tuple[Tier, bool]] = Counter()
        self._decode_hist: dict[Tier, deque[tuple[int, int]]] = {t: deque(maxlen=20) for t in Tier}
        self._step_ewma_ms = self.model.step_ms(16, config.limits.token_budget, 0, 0)

    # ------------------------------------------------------------------ events
    def open_session(self, sid: int, tier: Tier, now_ns: int, camera_fps: float = 30.0) -> None:
        """Admit a session; raises `SessionRefused` when the ladder refuses its tier."""
        if self.config.degrade and self.ladder.applies(Level.REFUSE_NEW_SESSIONS, tier):
            self.ledger.add(ShedReason.SESSION_REFUSED, tier, None)
            raise SessionRefused(self.ladder.refuse_message(tier))
        s = SessionState(sid, tier, now_ns, camera_fps, last_asr_done_ns=now_ns, last_vision_done_ns=now_ns)
        self.sessions[sid] = s
        self.open_tiers[tier] += 1
        if camera_fps > 0 and self.config.shape.vision_fps > 0:
            self._push_timer(now_ns, sid, _VISION, 0)

    def close_session(self, sid: int, now_ns: int) -> None:
        """Drop a session and its queued work (counted as `cancelled_on_close`)."""
        s = self._session(sid)
        for it in [it for it in self.items.values() if it.session_id == sid]:
            self._remove(it)
            self.ledger.note("cancelled_on_close")
        s.closed = True
        s.gen += 1
        self.open_tiers[s.tier] -= 1
        del self.sessions[sid]

    def speech_start(self, sid: int, now_ns: int) -> None:
        """The user started speaking: barge into any running answer, start ASR updates."""
        s = self._session(sid)
        self._barge_in(s)
        s.speaking = True
        s.turn_id += 1
        s.gen += 1
        s.last_asr_done_ns = now_ns
        self._push_timer(now_ns + int(self.config.shape.asr_interval_ms * MS), sid, _ASR, s.gen)

    def turn_end(self, sid: int, now_ns: int, tail_tokens: int, answer_tokens: int,
                 modality: WorkModality = WorkModality.SPEECH) -> None:
        """End of the user's turn: queue the final prefill whose completion is the first token."""
        s = self._session(sid)
        if modality is not WorkModality.SPEECH:
            self._barge_in(s)
            s.turn_id += 1
        s.speaking = False
        s.gen += 1
        tokens, asr = tail_tokens, (1 if modality is WorkModality.SPEECH else 0)
        for it in (s.queued_asr, s.queued_prefill):
            if it is not None:
                tokens += it.tokens
                self._remove(it)
                self.ledger.note("merged_into_turn_end")
        answer = answer_tokens
        short = self.config.ladder.short_answer_tokens
        if self.config.degrade and self.ladder.applies(Level.SHORTEN_ANSWERS, s.tier) and answer > short:
            self.ledger.add(ShedReason.ANSWER_SHORTENED, s.tier, Kind.DECODE, answer - short)
            answer = short
        target_ns = int(self.config.tiers[s.tier].p99_target_ms * MS)
        q = s.queued_turn_end
        if q is not None:
            # More input before the previous end of turn was served (e.g. a typed message right
            # after speaking): one answer covers both, timed from the latest end of input.
            q.tokens += max(1, tokens)
            q.asr_units = max(q.asr_units, asr)
            q.turn_end_ns, q.deadline_ns, q.turn_id = now_ns, now_ns + target_ns, s.turn_id
            q.meta["answer"] = answer
            self.ledger.note("turn_ends_merged")
            return
        it = self._new_item(s, modality, Kind.TURN_END, now_ns, now_ns + target_ns, tokens=max(1, tokens),
                            asr_units=asr)
        it.turn_end_ns = now_ns
        it.meta["answer"] = answer
        if self._enqueue(it, now_ns):
            s.queued_turn_end = it

    def prefill(self, sid: int, now_ns: int, tokens: int) -> None:
        """``tokens`` more prompt positions of ``sid``'s turn are known before it ends (partial
        words, vision tokens): queue them as incremental prefill (merged with what is queued)."""
        if tokens > 0:
            self._add_prefill(self._session(sid), tokens, now_ns)

    def text_message(self, sid: int, now_ns: int, tokens: int, answer_tokens: int) -> None:
        """A typed message: a text turn that ends as it arrives."""
        self.turn_end(sid, now_ns, tokens, answer_tokens, WorkModality.TEXT)

    # ------------------------------------------------------------------ planning
    def plan(self, now_ns: int) -> BatchPlan:
        """Choose the work of the next engine step."""
        self._fire_timers(now_ns)
        self._expire(now_ns)
        self._control(now_ns)
        self.step_no += 1
        fills = {sid: s.fill(now_ns, self._ring_ns) for sid, s in self.sessions.items()}
        ordered = self.policy.order(list(self.items.values()), now_ns, fills)
        running = [it for it in ordered if it.kind is Kind.DECODE and self._ran_last_step(it)]
        if self.config.preempt:
            sticky: list[WorkItem] = []
        else:
            sticky = sorted(running, key=lambda it: (self._answer_start(it), it.item_id))
        if self.config.adaptive:
            # Only a step that carries first tokens is capped, by the strictest tier waiting for
            # one; other steps run at full size so throughput is not given away under load.
            budget = self.controllers.step_budget_ms({it.tier for it in ordered if it.kind is Kind.TURN_END})
        else:
            budget = self.config.fixed_budget_ms
        if isinstance(self.model, CalibratedStepTime):
            budget = max(budget, self._floor())
        due = now_ns + int(self.config.policy.pace_slack_ms * MS)
        plan = self.batcher.build(ordered, budget, sticky, due_before_ns=due)
        in_plan = {e.item.item_id for e in plan.entries}
        for it in running:
            if it.item_id not in in_plan:
                self.ledger.note(f"preempted_decode_{it.tier.name.lower()}")
        for e in plan.entries:
            if e.item.kind is Kind.DECODE:
                a = self.sessions[e.item.session_id].answer
                if a is not None:
                    a.last_step = self.step_no
        self._hash.update(repr((now_ns, [(e.item.item_id, e.tokens) for e in plan.entries])).encode())
        return plan

    def complete(self, plan: BatchPlan, result: StepResult, now_ns: int) -> None:
        """Apply the outcome of an executed step at `now_ns` (its end)."""
        sh = self.config.shape
        self._step_ewma_ms += 0.05 * (result.duration_ns / MS - self._step_ewma_ms)
        if isinstance(self.model, CalibratedStepTime):
            self.model.observe(plan.decode, plan.prefill_tokens, plan.images, plan.asr_units, result.duration_ns / MS)
        for e in plan.entries:
            it = e.item
            if it.item_id not in self.items:
                continue
            if not e.completes:
                it.tokens -= e.tokens
                it.asr_units = 0
                continue
            self._remove(it)
            s = self.sessions.get(it.session_id)
            if s is None:
                continue
            if it.kind is Kind.ASR_CHUNK:
                s.last_asr_done_ns = now_ns
                if s.speaking:
                    self._add_prefill(s, sh.asr_tokens_per_update, now_ns)
            elif it.kind is Kind.VISION_FRAME:
                s.last_vision_done_ns = now_ns
                self.stats[f"{it.tier.name.lower()}/frames_encoded"] += 1
                self.vision_latency_ms[it.tier].append((now_ns - it.arrival_ns) / MS)
                if s.speaking:
                    self._add_prefill(s, sh.vision_tokens_per_frame, now_ns)
            elif it.kind is Kind.TURN_END:
                self._first_token(s, it, now_ns)
            elif it.kind is Kind.DECODE:
                tn = it.tier.name.lower()
                self.stats[f"{tn}/decode_tokens"] += 1
                late = now_ns > it.deadline_ns
                self._period_decode[(it.tier, late)] += 1
                if late:
                    self.stats[f"{tn}/decode_late"] += 1
                self._next_token(s, it, now_ns)
        for sid in result.finished_sessions:
            s = self.sessions.get(sid)
            if s is not None and s.answer is not None:
                if s.answer.queued is not None:
                    self._remove(s.answer.queued)
                s.answer = None
                self.ledger.note("answers_ended_by_eos")

    def next_timer_ns(self) -> int | None:
        """When the next internal timer (ASR / vision tick) fires, if any."""
        return self._timers[0][0] if self._timers else None

    def schedule_digest(self) -> str:
        """Hash of every plan so far (same seed → same digest)."""
        return self._hash.hexdigest()

    @property
    def level(self) -> Level:
        """Current degradation level."""
        return self.ladder.level

    # ------------------------------------------------------------------ internals
    def _floor(self) -> float:
        """Smallest step budget: one step carrying every kind of work (their fixed costs)."""
        return 1.1 * self.model.step_ms(1, self.config.limits.min_prefill_chunk, 1, 1)

    def _session(self, sid: int) -> SessionState:
        try:
            return self.sessions[sid]
        except KeyError:
            raise UnknownSession(f"session {sid} is not open (closed, refused or never opened)") from None

    def _new_item(self, s: SessionState, modality: WorkModality, kind: Kind, arrival: int, deadline: int,
                  tokens: int = 0, asr_units: int = 0, images: int = 0, token_index: int = 0,
                  frame_index: int = -1) -> WorkItem:
        self._next_id += 1
        return WorkItem(self._next_id, s.sid, s.tier, modality, kind, arrival, deadline, tokens=tokens,
                        asr_units=asr_units, images=images, turn_id=s.turn_id, token_index=token_index,
                        frame_index=frame_index)

    def _push_timer(self, t: int, sid: int, kind: int, gen: int) -> None:
        self._timer_seq += 1
        heapq.heappush(self._timers, (t, self._timer_seq, sid, kind, gen))

    def _enqueue(self, it: WorkItem, now_ns: int) -> bool:
        if self.queue_len[it.tier] >= self.config.queue[it.tier].max_queue_size:
            self._shed(it, ShedReason.QUEUE_FULL, now_ns)
            return False
        self.items[it.item_id] = it
        self.queue_len[it.tier] += 1
        return True

    def _remove(self, it: WorkItem) -> None:
        if self.items.pop(it.item_id, None) is None:
            return
        self.queue_len[it.tier] -= 1
        s = self.sessions.get(it.session_id)
        if s is None:
            return
        if s.queued_asr is it:
            s.queued_asr = None
        elif s.queued_prefill is it:
            s.queued_prefill = None
        elif s.queued_turn_end is it:
            s.queued_turn_end = None
        elif it.kind is Kind.VISION_FRAME and it in s.queued_frames:
            s.queued_frames.remove(it)
        elif s.answer is not None and s.answer.queued is it:
            s.answer.queued = None

    def _shed(self, it: WorkItem, reason: ShedReason, now_ns: int) -> None:
        """Count a shed item and undo what depended on it."""
        self._remove(it)
        self.ledger.add(reason, it.tier, it.kind)
        s = self.sessions.get(it.session_id)
        if it.kind is Kind.TURN_END:
            self.turns.append(ServedTurn(it.session_id, it.tier, it.modality, it.turn_end_ns, math.inf, reason))
            self.controllers.record(it.tier, now_ns, math.inf)
        elif it.kind is Kind.DECODE and s is not None and s.answer is not None:
            self.ledger.add(ShedReason.ANSWER_ABORTED, it.tier, Kind.DECODE, s.answer.total - s.answer.produced)
            s.answer = None

    def _barge_in(self, s: SessionState) -> None:
        a = s.answer
        if a is None:
            return
        if a.queued is not None:
            self._remove(a.queued)
        self.ledger.note("barge_in_cancelled_tokens", a.total - a.produced)
        s.answer = None

    def _add_prefill(self, s: SessionState, n: int, now_ns: int) -> None:
        if s.queued_turn_end is not None:
            s.queued_turn_end.tokens += n
        elif s.queued_prefill is not None:
            s.queued_prefill.tokens += n
        else:
            dl = now_ns + int(self.config.shape.prefill_deadline_ms * MS)
            # Incremental prefill of a spoken turn is speech work: it is what keeps the end of
            # the turn small (and its first token fast) when the turn ends.
            mod = WorkModality.SPEECH if s.speaking else WorkModality.TEXT
            it = self._new_item(s, mod, Kind.PREFILL, now_ns, dl, tokens=n)
            if self._enqueue(it, now_ns):
                s.queued_prefill = it

    def _first_token(self, s: SessionState, it: WorkItem, now_ns: int) -> None:
        lat = (now_ns - it.turn_end_ns) / MS
        self.turns.append(ServedTurn(s.sid, s.tier, it.modality, it.turn_end_ns, lat))
        self.controllers.record(s.tier, now_ns, lat)
        total = it.meta.get("answer", 1)
        s.answer = AnswerState(it.turn_id, total, 1, now_ns)
        self._queue_decode(s, now_ns)

    def _next_token(self, s: SessionState, it: WorkItem, now_ns: int) -> None:
        a = s.answer
        if a is None or a.turn_id != it.turn_id:
            return
        a.produced += 1
        self._queue_decode(s, now_ns)

    def _queue_decode(self, s: SessionState, now_ns: int) -> None:
        a = s.answer
        assert a is not None
        if a.produced >= a.total:
            s.answer = None
            self.ledger.note("answers_completed")
            return
        pace = int(self.config.shape.decode_pace_ms * MS)
        it = self._new_item(s, WorkModality.TEXT, Kind.DECODE, now_ns, a.first_ns + pace * a.produced,
                            tokens=1, token_index=a.produced)
        it.turn_id = a.turn_id
        if self._enqueue(it, now_ns):
            a.queued = it

    def _ran_last_step(self, it: WorkItem) -> bool:
        s = self.sessions.get(it.session_id)
        return s is not None and s.answer is not None and s.answer.last_step == self.step_no - 1

    def _answer_start(self, it: WorkItem) -> int:
        s = self.sessions.get(it.session_id)
        return s.answer.first_ns if s is not None and s.answer is not None else 0

    def _fire_timers(self, now_ns: int) -> None:
        sh = self.config.shape
        while self._timers and self._timers[0][0] <= now_ns:
            t, _, sid, kind, gen = heapq.heappop(self._timers)
            s = self.sessions.get(sid)
            if s is None or s.closed:
                continue
            if kind == _ASR:
                if gen != s.gen or not s.speaking:
                    continue
                if s.queued_asr is not None:
                    self.ledger.note("asr_updates_merged")
                else:
                    it = self._new_item(s, WorkModality.SPEECH, Kind.ASR_CHUNK, t,
                                        t + int(sh.asr_deadline_ms * MS), asr_units=1)
                    if self._enqueue(it, now_ns):
                        s.queued_asr = it
                self._push_timer(t + int(sh.asr_interval_ms * MS), sid, _ASR, gen)
            else:
                self._vision_tick(s, t, now_ns)

    def _vision_tick(self, s: SessionState, t: int, now_ns: int) -> None:
        sh, lad = self.config.shape, self.config.ladder
        normal = int(1e9 / sh.vision_fps)
        lowered = self.config.degrade and self.ladder.applies(Level.LOWER_VISION_RATE, s.tier)
        period = int(normal / lad.vision_rate_factor) if lowered else normal
        frame = int((t - s.opened_ns) * s.camera_fps / 1e9)
        if s.last_frame_index >= 0:
            self.ledger.note("frames_not_sampled", max(0, frame - s.last_frame_index - 1))
            skipped_ticks = round((t - s.last_vision_tick_ns) / normal) - 1
            if skipped_ticks > 0:
                self.ledger.add(ShedReason.VISION_RATE, s.tier, Kind.VISION_FRAME, skipped_ticks)
        s.last_frame_index, s.last_vision_tick_ns = frame, t
        if self.config.degrade and self.ladder.applies(Level.DROP_STALE_VIDEO, s.tier):
            for old in list(s.queued_frames):
                self._remove(old)
                self.ledger.add(ShedReason.STALE_VIDEO, s.tier, Kind.VISION_FRAME)
        it = self._new_item(s, WorkModality.VISION, Kind.VISION_FRAME, t, t + int(sh.vision_deadline_ms * MS),
                            images=1, frame_index=frame)
        if self._enqueue(it, now_ns):
            s.queued_frames.append(it)
        self._push_timer(t + period, s.sid, _VISION, 0)

    def _expire(self, now_ns: int) -> None:
        for it in list(self.items.values()):
            pol = self.config.queue[it.tier]
            to = pol.timeouts_ms.get(it.kind)
            if to is None or now_ns - it.arrival_ns <= to * MS:
                continue
            if pol.action(it.kind) is TimeoutAction.REJECT:
                self._shed(it, ShedReason.TIMEOUT, now_ns)
            elif not it.delayed:
                it.delayed = True
                self.ledger.note("delayed_by_timeout")

    def _control(self, now_ns: int) -> None:
        if now_ns < self._next_ctrl_ns:
            return
        self._next_ctrl_ns = now_ns + int(self.config.aimd.period_ms * MS)
        self.controllers.tick(now_ns)
        for t in Tier:
            self._decode_hist[t].append((self._period_decode[(t, False)] + self._period_decode[(t, True)],
                                         self._period_decode[(t, True)]))
        self._period_decode.clear()
        if self.config.degrade:
            per = {t: p for t in Tier if (p := self.pressure(t, now_ns)) is not None}
            backlog = self.backlog_pressure()
            degradable = [p for t, p in per.items() if t not in self.config.ladder.exempt]
            self.ladder.update(now_ns, max([backlog, *per.values()]), max([backlog, *degradable]))

    def backlog_pressure(self) -> float:
        """Leading overload signal: time to drain the queued prefill at the per-step token
        budget, over the tightest target among tiers the ladder may degrade (> 1: their next
        ends of turn will miss unless work is shed now)."""
        tokens = sum(it.tokens for it in self.items.values()
                     if it.kind in (Kind.PREFILL, Kind.TURN_END) and not it.delayed)
        steps = tokens / self.config.limits.token_budget
        exempt = self.config.ladder.exempt
        targets = [s.p99_target_ms for t, s in self.config.tiers.items() if t not in exempt]
        return steps * self._step_ewma_ms / min(targets) if targets else 0.0

    def pressure(self, tier: Tier, now_ns: int) -> float | None:
        """How far `tier` is from its promises: max of response P99 / target and late-decode
        share / allowed share (over the last ~2 s); > 1 means overloaded."""
        p = self.controllers.pressure(tier, now_ns)
        tokens = sum(n for n, _ in self._decode_hist[tier])
        if tokens >= 20:
            late = sum(k for _, k in self._decode_hist[tier]) / tokens
            q = late / self.config.ladder.max_late_decode_fraction
            p = q if p is None else max(p, q)
        return p
