"""Fault injection (issue 9 item 4): an LLM engine whose step raises, for the real engine thread.

`FaultyEngine` has the `LLMEngine` surface `EngineChatBackend` uses (`add_request`, `step`,
`cancel`, `has_work`) and produces one token per live sequence per step; from step call
``fail_after`` on, every step raises until ``broken_steps`` calls have failed (a transient
fault the engine recovers from by itself; the cancelled sequences' blocks are freed).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any


class InjectedFault(RuntimeError):
    """The fault a test injects."""


@dataclass(slots=True)
class _Out:
    seq_id: int
    text: str
    finished: bool


class FaultyEngine:
    """See the module docstring; `live` is the number of sequences holding "KV blocks"."""

    def __init__(self, tokens_per_answer: int = 40, fail_after: int | None = None, broken_steps: int = 1) -> None:
        self.tokens_per_answer = tokens_per_answer
        self.fail_after = fail_after
        self.broken_steps = broken_steps
        self.calls = 0
        self.failures = 0
        self.seqs: dict[int, int] = {}  # seq_id -> tokens produced
        self.limits: dict[int, int] = {}
        self._ids = itertools.count(1)
        self._cancels: list[int] = []
        self._lock = threading.Lock()

    def add_request(self, chat: Any = None, params: Any = None, **_: Any) -> int:
        with self._lock:
            sid = next(self._ids)
            self.seqs[sid] = 0
            self.limits[sid] = min(self.tokens_per_answer, getattr(params, "max_tokens", None) or 10**9)
            return sid

    def cancel(self, seq_id: int) -> None:
        with self._lock:
            self._cancels.append(seq_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.seqs) or bool(self._cancels)

    @property
    def live(self) -> int:
        with self._lock:
            return len(self.seqs)

    def step(self) -> list[_Out]:
        with self._lock:
            for sid in self._cancels:  # commands apply first, as in LLMEngine.step
                self.seqs.pop(sid, None)
            self._cancels.clear()
            self.calls += 1
            if self.fail_after is not None and self.calls > self.fail_after \
                    and self.failures < self.broken_steps:
                self.failures += 1
                raise InjectedFault(f"injected fault in engine step {self.calls}")
            outs = []
            for sid in list(self.seqs):
                self.seqs[sid] += 1
                done = self.seqs[sid] >= self.limits[sid]
                outs.append(_Out(sid, f" t{self.seqs[sid]}", done))
                if done:
                    del self.seqs[sid]
            return outs
