"""`ScheduledEngine`: the server's turns on our `LLMEngine`, planned step by step by `tristream.sched`.

One per process. A dedicated thread owns the engine and one cross-session `Scheduler`
(ours by default): sessions' turns arrive from the asyncio loop as commands, the thread
applies them at step boundaries, asks the scheduler for the next plan, runs it on the engine
(`TurnExecutor`) and hands the outputs back to each turn's asyncio queue. With CUDA the engine
replays its captured graphs; on a CPU the same code runs eagerly.

What the scheduler sheds reaches the turn as ``("shed", reason)`` as soon as the scheduler
decides it, at most one engine step later: a TURN_END refused by a full tier queue
(``queue_full``) or expired before it ran (``timeout``), an answer aborted because its
decode tokens timed out (``answer_aborted``), a session refused by admission control
(``session_refused``). Every shed is also in the scheduler's ledger (``/metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tristream.observe.events import TurnDelta, TurnEnd, TurnEvent
from tristream.sched.admission import ShedReason
from tristream.sched.clock import WallClock
from tristream.sched.config import SchedulerConfig, ours_config
from tristream.sched.scheduler import Scheduler
from tristream.sched.steptime import CalibratedStepTime, StepTimeModel
from tristream.sched.turn_executor import Span, TurnExecutor
from tristream.sched.types import SessionRefused, Tier, UnknownSession, WorkModality

log = logging.getLogger("tristream.serve")
_TOKEN_TEXT = re.compile(r"( t\d+)+")
TIERS = {t.name.lower(): t for t in Tier}


@dataclass(slots=True)
class TurnHandle:
    """One answer in flight: its events arrive on ``events`` (on the submitting loop).

    Events (`tristream.observe.events`): `TurnDelta` with answer text, then one `TurnEnd`
    (``done`` with the finish reason, ``shed`` with the scheduler's reason, ``error`` with the message).
    """

    sid: int
    turn: int
    events: asyncio.Queue[TurnEvent] = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop | None = None
    t_submit_ns: int = 0


class ScheduledEngine:
    """See the module docstring. Thread-safe entry points: `open`, `submit`, `cancel`, `close`."""

    def __init__(self, engine: Any, config: SchedulerConfig | None = None, temperature: float = 0.0,
                 repetition_penalty: float = 1.1) -> None:
        self.engine = engine
        self.clock = WallClock()
        self.sched = Scheduler(config or ours_config(), CalibratedStepTime(StepTimeModel()))
        self.executor = TurnExecutor(engine, temperature, repetition_penalty)
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.vocab = int(engine.model.cfg.vocab_size)
        self.handles: dict[int, TurnHandle] = {}
        self.tiers: dict[int, Tier] = {}
        self.counters: dict[str, int] = {}
        self.steps = 0
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._next_sid = 0
        self._sid_lock = threading.Lock()
        self._turns_seen = 0
        self._tail: int | None = None
        self._thread = threading.Thread(target=self._run, name="tristream-sched-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- loop side
    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt token ids: the chat template, or for a model without tokenizer each message's
        bytes mod vocab plus a newline, where an assistant message written as ``" t<id>"`` tokens
        (what such a model answers) is its ids again, so the history stays in the prefix cache."""
        if self.tokenizer is not None:
            return list(self.tokenizer.apply_chat_template(messages))
        out: list[int] = []
        for m in messages:
            text = m["content"]
            if m["role"] == "assistant" and _TOKEN_TEXT.fullmatch(text):
                out += [int(x) for x in text.split(" t")[1:]]
            else:
                out += [1 + b % (self.vocab - 1) for b in text.encode()]
            out.append(1 + 10 % (self.vocab - 1))
        return out

    def open(self, tier: str) -> int:
        """A new scheduler session at ``tier`` (gold / silver / bronze); returns its id."""
        with self._sid_lock:
            self._next_sid += 1
            sid = self._next_sid
        t = TIERS[tier]
        self._put(lambda: self._open(sid, t))
        return sid

    def encode_with_images(self, messages: list[dict[str, str]], images: list[Span]) -> tuple[list[int], dict[int, Span]]:
        """Prompt keys with ``images`` (embeddings and cache keys) as one user message of their own
        just before the last message, and the spans for `TurnExecutor`; without images `encode`."""
        if not images or not messages:
            return self.encode(messages), {}
        from tristream.engine.sequence import embedding_keys

        head = messages[:-1]
        a = self.encode([*head, {"role": "user", "content": "a"}, messages[-1]])
        b = self.encode([*head, {"role": "user", "content": "b"}, messages[-1]])
        pre = 0
        while pre < min(len(a), len(b)) and a[pre] == b[pre]:
            pre += 1
        post = 0
        while post < min(len(a), len(b)) - pre and a[-1 - post] == b[-1 - post]:
            post += 1
        keys, spans = a[:pre], {}
        for emb, key in images:
            run = embedding_keys(int(emb.shape[0]), key)
            spans[run[0]] = (emb, key)
            keys += run
        return keys + a[len(a) - post:], spans

    def stable_prefix(self, keys: list[int], slack: int = 2) -> list[int]:
        """A partial turn's prompt without the chat template's closing tokens and the last ``slack``
        tokens of the words (the next partial usually extends what is left)."""
        if self._tail is None:
            x = self.encode([{"role": "user", "content": "a"}])
            y = self.encode([{"role": "user", "content": "b c"}])
            n = 0
            while n < min(len(x), len(y)) - 1 and x[-1 - n] == y[-1 - n]:
                n += 1
            self._tail = n
        return keys[:max(0, len(keys) - self._tail - slack)]

    def submit(self, sid: int, prompt: list[int], max_tokens: int, modality: WorkModality,
               spans: dict[int, Span] | None = None) -> TurnHandle:
        """End of a user turn: answer ``prompt`` (call on the event loop; events come back there)."""
        h = TurnHandle(sid, 0, loop=asyncio.get_running_loop(), t_submit_ns=self.clock.now_ns())
        self._put(lambda: self._turn(h, prompt, max_tokens, modality, spans))
        return h

    def prefill(self, sid: int, prompt: list[int], spans: dict[int, Span] | None = None) -> None:
        """The user is still speaking: ``prompt`` (the turn so far) enters the session's context as
        incremental prefill, planned by the scheduler (`TurnExecutor.open`)."""
        self._put(lambda: self._prefill(sid, prompt, spans))

    def cancel(self, sid: int) -> None:
        """Stop the session's answer (barge-in, ``response.cancel``) at the next step boundary."""
        self._put(lambda: self._cancel(sid, "cancelled"))

    def close(self, sid: int) -> None:
        """The session ended."""
        self._put(lambda: self._close(sid))

    def shutdown(self) -> None:
        """Stop the thread (tests, process exit)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    def stats(self) -> dict[str, Any]:
        """Counters, the scheduler's shed ledger and the engine's step count (for /metrics)."""
        ex = self.executor
        counters = {**self.counters, "embedding_positions": ex.embedding_positions,
                    "contexts_reused": ex.contexts_reused, "contexts_restarted": ex.contexts_restarted,
                    "cached_prompt_tokens": ex.cached_tokens, "prefill_tokens": ex.prefill_tokens}
        return {"counters": counters, "shed": self.sched.ledger.to_dict(), "steps": self.steps,
                "healthy": self.error is None}

    def _put(self, cmd: Callable[[], None]) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # ---------------------------------------------------------------- engine thread
    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _send(self, h: TurnHandle, kind: str, value: str) -> None:
        """``kind`` ``delta``: answer text; ``done`` / ``shed`` / ``error``: the end of the turn."""
        if h.loop is not None and not h.loop.is_closed():
            ev: TurnEvent = TurnDelta(value) if kind == "delta" else TurnEnd(kind, value)
            h.loop.call_soon_threadsafe(h.events.put_nowait, ev)

    def _end(self, sid: int, kind: str, value: str) -> None:
        h = self.handles.pop(sid, None)
        if h is not None:
            self._send(h, kind, value)

    def _open(self, sid: int, tier: Tier) -> None:
        self.tiers[sid] = tier
        try:
            self.sched.open_session(sid, tier, self.clock.now_ns(), camera_fps=0.0)
        except SessionRefused:
            self._count("sessions_refused")
            self.tiers[sid] = tier  # turns of a refused session are shed one by one (below)

    def _prefill(self, sid: int, prompt: list[int], spans: dict[int, Span] | None) -> None:
        if sid not in self.sched.sessions or sid in self.handles:  # refused, or an answer runs
            self._count("prefills_skipped")
            return
        if len(prompt) >= int(self.engine.config.max_model_len) - 64:
            self._count("prefills_too_long")
            return
        n = self.executor.open(sid, prompt, spans)
        self._count("prefills")
        self.sched.prefill(sid, self.clock.now_ns(), n)

    def _turn(self, h: TurnHandle, prompt: list[int], max_tokens: int, modality: WorkModality,
              spans: dict[int, Span] | None = None) -> None:
        sid = h.sid
        if sid not in self.sched.sessions:  # refused at open (overload): retry admission now
            try:
                self.sched.open_session(sid, self.tiers[sid], self.clock.now_ns(), camera_fps=0.0)
            except SessionRefused:
                self._count("turns_shed_session_refused")
                self._send(h, "shed", ShedReason.SESSION_REFUSED.value)
                return
        if sid in self.handles:  # a new turn while one runs: the old answer is cut
            self._cancel(sid, "superseded")
        self.handles[sid] = h
        limit = int(self.engine.config.max_model_len) - max_tokens - 1
        if len(prompt) > limit:  # the oldest history goes first (vision tokens with it if they fall out)
            self._count("prompts_truncated")
            prompt = prompt[-limit:]
            while prompt and prompt[0] < 0:  # never start inside an embedding run
                prompt = prompt[1:]
        to_plan = self.executor.begin(sid, prompt, max_tokens, ignore_eos=self.tokenizer is None, spans=spans)
        now = self.clock.now_ns()
        try:
            self.sched.turn_end(sid, now, to_plan, max_tokens, modality)
        except UnknownSession:
            self._end(sid, "error", "session closed")

    def _cancel(self, sid: int, why: str) -> None:
        self.executor.cancel(sid)
        h = self.handles.pop(sid, None)
        if h is not None:
            self._send(h, "done", why)
        s = self.sched.sessions.get(sid)
        if s is not None and (s.answer is not None or s.queued_turn_end is not None):
            # the scheduler has no "cancel answer": a fresh session state drops the queued work (counted)
            self.sched.close_session(sid, self.clock.now_ns())
            self._count(f"answers_{why}")
            with contextlib.suppress(SessionRefused):  # under overload: re-admitted at its next turn
                self.sched.open_session(sid, s.tier, self.clock.now_ns(), camera_fps=0.0)

    def _close(self, sid: int) -> None:
        self._cancel(sid, "session_closed")
        self.executor.release(sid)
        if sid in self.sched.sessions:
            self.sched.close_session(sid, self.clock.now_ns())
        self.tiers.pop(sid, None)

    def _report_sheds(self) -> None:
        turns = self.sched.turns
        for rec in turns[self._turns_seen:]:
            if rec.shed is not None and rec.session_id in self.handles:
                self._count(f"turns_shed_{rec.shed.value}")
                self.executor.cancel(rec.session_id)
                self._end(rec.session_id, "shed", rec.shed.value)
        if len(turns) > 1024:  # the scheduler keeps every turn's record: bounded for a long-running server
            del turns[: len(turns) - 1024]
        self._turns_seen = len(turns)
        for sid in self.executor.generating():
            s = self.sched.sessions.get(sid)
            if s is not None and s.answer is None and s.queued_turn_end is None:
                # decode tokens timed out: the scheduler aborted the answer
                self._count("answers_shed_answer_aborted")
                self.executor.cancel(sid)
                self._end(sid, "shed", ShedReason.ANSWER_ABORTED.value)

    def _run(self) -> None:
        while not self._stop:
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    cmd()
                except Exception:  # one bad command must not stop the engine thread for everyone
                    log.exception("scheduled engine: a session command failed")
                    self._count("command_errors")
            now = self.clock.now_ns()
            plan = self.sched.plan(now)
            self._report_sheds()
            if plan.empty:
                if self.engine.has_work():  # cancellations: the engine frees their blocks when it drains
                    self.engine.step(allow=set())
                nxt = self.sched.next_timer_ns()
                wait = 0.05 if nxt is None else min(0.05, max(0.0, (nxt - now) / 1e9))
                self._wake.wait(wait)
                self._wake.clear()
                continue
            try:
                res, outs = self.executor.execute(plan)
            except Exception as exc:  # the engine failed: every answer in flight fails, the loop goes on
                log.exception("engine step failed")
                self.error = exc
                self._count("engine_step_errors")
                for sid in list(self.handles):
                    self.executor.cancel(sid)
                    self._end(sid, "error", f"{type(exc).__name__}: {exc}")
                continue
            self.error = None
            self.steps += 1
            self.sched.complete(plan, res, self.clock.now_ns())
            for sid, text, finished, reason in outs:
                h = self.handles.get(sid)
                if h is None:
                    continue
                if text:
                    self._send(h, "delta", text)
                if finished:
                    self._end(sid, "done", reason)
            self._report_sheds()
