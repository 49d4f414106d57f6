"""Asyncio front end: the engine steps on its own thread; callers get async streams of deltas.

    llm = AsyncLLM(LLMEngine.from_path(path))
    stream = llm.submit(chat=[{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=64),
                        priority=2, deadline=time.monotonic() + 0.5)
    async for d in stream:          # Delta(text, token_id, finished, finish_reason)
        print(d.text, end="")
    stream.cancel()                 # barge-in: the slot is freed at the engine's next step

Incremental prefill: `ctx = llm.open_context(token_ids)`, then `ctx.append(...)` while the
user speaks and `ctx.generate(params)` at the end of the turn (see `engine` module docs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
from collections.abc import AsyncIterator

import torch

from tristream.engine.engine import LLMEngine, StepOutput
from tristream.engine.sequence import FinishReason, SamplingParams


@dataclasses.dataclass(slots=True)
class Delta:
    """New text (and token) of one request."""

    text: str
    token_id: int | None
    finished: bool
    finish_reason: FinishReason | None = None


class RequestStream:
    """Async iterator over a request's deltas."""

    def __init__(self, llm: AsyncLLM, seq_id: int) -> None:
        self.llm = llm
        self.seq_id = seq_id
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.done = False

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Delta]:
        while not self.done:
            d = await self.queue.get()
            if d.finished:
                self.done = True
            yield d

    async def text(self) -> str:
        """Wait for the whole answer."""
        return "".join([d.text async for d in self])

    def cancel(self) -> None:
        """Stop generating; the engine frees the sequence's blocks at its next step."""
        self.llm.engine.cancel(self.seq_id)
        self.llm.wake()


class ContextHandle:
    """An open context for incremental prefill."""

    def __init__(self, llm: AsyncLLM, seq_id: int) -> None:
        self.llm = llm
        self.seq_id = seq_id

    def append(self, token_ids: list[int] | None = None, text: str | None = None,
               embeddings: torch.Tensor | None = None, cache_key: str | None = None) -> None:
        self.llm.engine.append(self.seq_id, token_ids=token_ids, text=text, embeddings=embeddings,
                               cache_key=cache_key)
        self.llm.wake()

    def generate(self, params: SamplingParams | None = None) -> RequestStream:
        stream = self.llm._register(self.seq_id)
        self.llm.engine.start_generation(self.seq_id, params)
        self.llm.wake()
        return stream

    def close(self) -> None:
        self.llm.engine.close(self.seq_id)
        self.llm.wake()


class AsyncLLM:
    """Runs `LLMEngine.step()` on a dedicated thread and routes outputs to asyncio streams."""

    SWITCH_INTERVAL_S = 0.0005

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Starts the engine thread. Lowers the interpreter's GIL switch interval (process-wide)
        from 5 ms to `SWITCH_INTERVAL_S`: the engine thread's host work between GPU waits would
        otherwise keep the event loop (sockets, deltas) off the GIL for up to 5 ms at a time."""
        if sys.getswitchinterval() > self.SWITCH_INTERVAL_S:
            sys.setswitchinterval(self.SWITCH_INTERVAL_S)
        self.engine = engine
        self.loop = loop
        self.streams: dict[int, RequestStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tristream-engine", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def _register(self, seq_id: int) -> RequestStream:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        s = RequestStream(self, seq_id)
        with self._lock:
            self.streams[seq_id] = s
        return s

    def submit(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None,
               priority: int = 0, deadline: float | None = None,
               chat: list[dict[str, str]] | None = None, kv_budget_tokens: int | None = None) -> RequestStream:
        """Start a request; returns its stream (call from the event loop's thread). `kv_budget_tokens`:
        this request's KV budget (default: the engine's; see `kv_retention.py`)."""
        seq_id = self.engine.add_request(prompt, params, priority=priority, deadline=deadline, chat=chat,
                                         kv_budget_tokens=kv_budget_tokens)
        stream = self._register(seq_id)
        self.wake()
        return stream

    def open_context(self, prompt: str | list[int] | None = None, priority: int = 0,
                     deadline: float | None = None, kv_budget_tokens: int | None = None) -> ContextHandle:
        """Open a context that is prefilled as input arrives; generate later. `kv_budget_tokens`:
        as for `submit` (a long-lived context under a budget evicts instead of growing)."""
        seq_id = self.engine.add_request(prompt, None, priority=priority, deadline=deadline, generate=False,
                                         kv_budget_tokens=kv_budget_tokens)
        self.wake()
        return ContextHandle(self, seq_id)

    def _deliver(self, outs: list[StepOutput]) -> None:
        with self._lock:
            for o in outs:
                s = self.streams.get(o.seq_id)
                if s is None:
                    continue
                s.queue.put_nowait(Delta(o.text, o.token_id, o.finished, o.finish_reason))
                if o.finished:
                    self.streams.pop(o.seq_id, None)

    def _run(self) -> None:
        while not self._stop:
            try:
                if not self.engine.has_work():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outs = self.engine.step()
            except BaseException as exc:  # surface engine failures to every waiting stream
                self.error = exc
                outs = [StepOutput(sid, None, "", True, FinishReason.ERROR) for sid in list(self.streams)]
                self._stop = True
            if outs and self.loop is not None:
                self.loop.call_soon_threadsafe(self._deliver, outs)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
