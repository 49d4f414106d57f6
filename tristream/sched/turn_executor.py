"""`TurnExecutor`: runs a scheduler's `BatchPlan` on the `LLMEngine` with the sessions' real prompts.

The mapping of plan entries onto engine calls is the one of `bench/real_backend.RealEngineBackend`
(one engine context per turn, a planned PREFILL / TURN_END chunk appended just before the step,
`start_generation` when the TURN_END completes so the chunk's logits give the first token in
this very step, `step(allow=..., max_batch=..., max_prefill_tokens=...)` so that sequences the
plan leaves out do not run). The difference: the tokens are the session's prompt, not random
ids, and the step's outputs (token text, end of answer) are returned to be delivered.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from tristream.sched.backend import StepResult
from tristream.sched.batcher import BatchPlan
from tristream.sched.types import Kind

Output = tuple[int, str, bool, str]
"""(scheduler session id, text delta, answer finished, finish reason)."""


@dataclass(slots=True)
class _Turn:
    head: list[int]
    """Prompt prefix found in the engine's prefix cache: sent with the first chunk, not planned."""
    feed: deque[int]
    max_tokens: int
    ignore_eos: bool
    seq: int | None = None
    generating: bool = False
    tokens_out: int = 0


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

    def begin(self, sid: int, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> int:
        """A new turn of ``sid``; returns how many of its prompt tokens the scheduler must plan
        (those past the cached prefix: the history and system prompt are usually cached)."""
        self.cancel(sid)
        cached = self.cached_prefix(prompt)
        self.turns[sid] = _Turn(prompt[:cached], deque(prompt[cached:]), max(1, max_tokens), ignore_eos)
        self.cached_tokens += cached
        return len(prompt) - cached

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

    def _take(self, t: _Turn, n: int) -> list[int]:
        return [t.feed.popleft() for _ in range(min(n, len(t.feed)))]

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
                toks = self._take(t, e.tokens)
                last = it.kind is Kind.TURN_END and e.completes
                if last and t.feed:  # the plan's count is the prompt's: nothing should be left
                    toks += self._take(t, len(t.feed))
                if t.seq is None:
                    t.seq = eng.add_request(t.head + toks, generate=False, priority=1)
                elif toks:
                    eng.append(t.seq, token_ids=toks)
                budget += len(toks)
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
