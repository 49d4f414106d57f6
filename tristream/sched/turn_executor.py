"""`TurnExecutor`: runs a scheduler's `BatchPlan` on the `LLMEngine` with the sessions' real prompts.

The mapping of plan entries onto engine calls is the one of `bench/real_backend.RealEngineBackend`
(one engine context per turn, a planned PREFILL / TURN_END chunk appended just before the step,
`start_generation` when the TURN_END completes so the chunk's logits give the first token in
this very step, `step(allow=..., max_batch=..., max_prefill_tokens=...)` so that sequences the
plan leaves out do not run). The difference: the tokens are the session's prompt, not random
ids, and the step's outputs (token text, end of answer) are returned to be delivered.

While the user speaks, `open` keeps one engine context per session fed with the prompt so far
(planned as PREFILL); at the end of the turn `begin` continues that context when the final prompt
keeps what was sent, so only the tail is left. Prompts may hold precomputed embeddings (vision
tokens) as runs of negative keys (`Span`): they reach the engine through `LLMEngine.append(embeddings=)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tristream.sched.backend import StepResult
from tristream.sched.batcher import BatchPlan
from tristream.sched.types import Kind

Output = tuple[int, str, bool, str]
"""(scheduler session id, text delta, answer finished, finish reason)."""

Span = tuple[Any, str]
"""Precomputed embeddings ``[n, hidden]`` (vision tokens) and their cache key: in a prompt they are
the ``n`` negative keys `tristream.engine.sequence.embedding_keys(n, key)`, and a span is never split."""

Segment = list[int] | Span


@dataclass(slots=True)
class _Turn:
    keys: list[int]
    """The whole prompt; negative keys are embedding positions (``spans``)."""
    head: int
    """Leading positions found in the engine's prefix cache: sent with the first chunk, not planned."""
    spans: dict[int, Span]
    """First key of each embedding run -> its embeddings and cache key."""
    max_tokens: int
    ignore_eos: bool
    sent: int = 0
    """Positions handed to the engine so far."""
    seq: int | None = None
    generating: bool = False
    tokens_out: int = 0
    opened: bool = field(default=False)
    """Started by `open` (incremental prefill while the user speaks), not yet the answer's turn."""


class TurnExecutor:
    """Per-session turn state and the plan → engine step mapping (engine thread only)."""

    def __init__(self, engine: Any, temperature: float = 0.0, repetition_penalty: float = 1.1) -> None:
        self.engine = engine
        self.temperature = temperature
        self.repetition_penalty = repetition_penalty
        self.turns: dict[int, _Turn] = {}
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.cached_tokens = 0
        self.embedding_positions = 0
        """Embedding positions (vision tokens) handed to the engine."""
        self.contexts_reused = 0
        """Turns whose answer started from the context prefilled while the user spoke."""
        self.contexts_restarted = 0
        """Open contexts dropped because the new prompt changed something already sent (prefix cache then)."""

    def cached_prefix(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` whose K/V the engine's prefix cache holds now (whole blocks; at
        least the last token is left to compute). A read-only probe of the block manager."""
        bm = self.engine.blocks
        if not bm.enable_prefix_cache:
            return 0
        bs, prev, n = bm.block_size, None, 0
        for i in range((len(prompt) - 1) // bs):
            chunk = tuple(prompt[i * bs:(i + 1) * bs])
            h = bm.chain_hash(prev, chunk)
            bid = bm.by_hash.get(h)
            if bid is None or bm.blocks[bid].keys != chunk:
                break
            prev, n = h, n + bs
        return n

    def _new(self, sid: int, keys: list[int], spans: dict[int, Span] | None, max_tokens: int,
             ignore_eos: bool) -> _Turn:
        self.cancel(sid)
        spans = dict(spans or {})
        cached = self.cached_prefix(keys)
        while 0 < cached < len(keys) and keys[cached] < 0 and keys[cached] not in spans:
            cached -= 1  # never start the planned part inside an embedding run
        t = _Turn(keys, cached, spans, max(1, max_tokens), ignore_eos)
        self.turns[sid] = t
        self.cached_tokens += cached
        return t

    def _extends(self, t: _Turn | None, keys: list[int]) -> bool:
        """``keys`` keeps every position of ``t`` already sent to the engine (its context goes on)."""
        return (t is not None and not t.generating and t.seq is not None and len(keys) >= t.sent
                and keys[:t.sent] == t.keys[:t.sent])

    def open(self, sid: int, keys: list[int], spans: dict[int, Span] | None = None) -> int:
        """The user is still speaking: ``keys`` is the prompt so far (without the part that may still
        change). Returns how many new positions the scheduler must plan as incremental prefill; 0
        while an answer runs. A prompt that changes what was sent restarts the context (its full
        blocks stay in the prefix cache)."""
        t = self.turns.get(sid)
        if t is not None and t.generating:
            return 0
        if t is not None and self._extends(t, keys):
            before = len(t.keys) - t.sent
            t.keys = keys
            t.spans.update(spans or {})
            return max(0, len(keys) - t.sent - before)
        if t is not None and t.seq is not None:
            self.contexts_restarted += 1
        t = self._new(sid, keys, spans, 1, False)
        t.opened = True
        return len(keys) - t.head

    def begin(self, sid: int, prompt: list[int], max_tokens: int, ignore_eos: bool = False,
              spans: dict[int, Span] | None = None) -> int:
        """A new turn of ``sid``; returns how many of its prompt tokens the scheduler must plan
        (those past the cached prefix, or past what the open context of `open` already holds)."""
        t = self.turns.get(sid)
        if t is not None and t.opened and self._extends(t, prompt):
            t.keys, t.max_tokens, t.ignore_eos, t.opened = prompt, max(1, max_tokens), ignore_eos, False
            t.spans.update(spans or {})
            self.contexts_reused += 1
            return len(prompt) - t.sent
        if t is not None and t.opened and t.seq is not None:
            self.contexts_restarted += 1
        t = self._new(sid, prompt, spans, max_tokens, ignore_eos)
        return len(prompt) - t.head

    def cancel(self, sid: int) -> None:
        """Drop the turn; the engine frees its blocks at the next step."""
        t = self.turns.pop(sid, None)
        if t is not None and t.seq is not None:
            self.engine.cancel(t.seq)

    def release(self, sid: int) -> None:
        """Session closed (the `EngineBackend` protocol of `tristream.sched.backend`)."""
        self.cancel(sid)

    def generating(self) -> list[int]:
        """Sessions whose answer is being decoded."""
        return [sid for sid, t in self.turns.items() if t.generating]

    def _take(self, t: _Turn, n: int) -> tuple[list[Segment], int]:
        """The next ``n`` positions of ``t`` as segments (an embedding run is taken whole) and their count."""
        segs: list[Segment] = []
        ids: list[int] = []
        i, end, keys = t.sent, min(len(t.keys), t.sent + n), t.keys
        while i < end:
            k = keys[i]
            span = t.spans.get(k) if k < 0 else None
            if span is None:
                ids.append(k)
                i += 1
                continue
            if ids:
                segs.append(ids)
                ids = []
            segs.append(span)
            i += int(span[0].shape[0])
            self.embedding_positions += int(span[0].shape[0])
        if ids:
            segs.append(ids)
        taken, t.sent = i - t.sent, i
        return segs, taken

    def _send(self, t: _Turn, segs: list[Segment]) -> None:
        eng = self.engine
        for seg in segs:
            if t.seq is None:
                t.seq = eng.add_request(seg if isinstance(seg, list) else [], generate=False, priority=1)
                if isinstance(seg, list):
                    continue
            if isinstance(seg, list):
                eng.append(t.seq, token_ids=seg)
            else:
                eng.append(t.seq, embeddings=seg[0], cache_key=seg[1])

    def execute(self, plan: BatchPlan) -> tuple[StepResult, list[Output]]:
        """Run ``plan``; returns its result for the scheduler and the outputs for the sessions."""
        from tristream.engine.sequence import FinishReason, SamplingParams

        eng = self.engine
        t0 = time.perf_counter_ns()
        budget = 0
        planned: set[int] = set()
        decode: set[int] = set()
        first: set[int] = set()
        for e in plan.entries:
            it, sid = e.item, e.item.session_id
            t = self.turns.get(sid)
            if t is None:
                continue
            if it.kind in (Kind.PREFILL, Kind.TURN_END) and not t.generating:
                last = it.kind is Kind.TURN_END and e.completes
                if t.seq is None and t.head:  # the cached prefix goes with the first chunk, unplanned
                    head, _ = self._take(t, t.head - t.sent)
                    self._send(t, head)
                segs, n = self._take(t, len(t.keys) if last else e.tokens)  # a TURN_END leaves nothing
                self._send(t, segs)
                if t.seq is None:  # nothing to send yet (an empty first chunk): open the context
                    t.seq = eng.add_request([], generate=False, priority=1)
                budget += n
                planned.add(t.seq)
                if last:
                    eng.start_generation(t.seq, SamplingParams(
                        max_tokens=t.max_tokens, temperature=self.temperature,
                        repetition_penalty=self.repetition_penalty, ignore_eos=t.ignore_eos))
                    t.generating = True
                    first.add(t.seq)
            elif it.kind is Kind.DECODE and t.generating and t.seq is not None:
                decode.add(t.seq)
        planned |= decode
        outs = eng.step(allow=planned, max_batch=max(1, len(decode | first)),
                        max_prefill_tokens=max(1, budget)) if planned else eng.step(allow=set())
        owner = {t.seq: sid for sid, t in self.turns.items() if t.seq is not None}
        result: list[Output] = []
        finished: set[int] = set()
        for o in outs:
            sid_ = owner.get(o.seq_id)
            if sid_ is None or o.token_id is None:
                continue
            t = self.turns[sid_]
            t.tokens_out += 1
            text = o.text if eng.tokenizer is not None else f" t{o.token_id}"
            if o.finished and o.finish_reason is FinishReason.EOS:
                text = ""
            reason = o.finish_reason.value if o.finish_reason is not None else ""
            result.append((sid_, text, o.finished, reason))
            if o.finished:
                finished.add(sid_)
                del self.turns[sid_]
        self.prefill_tokens += budget
        self.decode_tokens += len(decode)
        return StepResult(duration_ns=max(1, time.perf_counter_ns() - t0), finished_sessions=finished), result
