"""LLM backends of the pipeline: our engine in-process, or any OpenAI-compatible endpoint.

Both stream text deltas through one async-iterator interface; closing the iterator (the
LLM stage is cancelled on barge-in) cancels the generation: the engine frees the sequence's
KV blocks at its next step, the HTTP backend closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from tristream.pipeline.prompt import DECODE, DecodeSettings


class LlmEndpointError(RuntimeError):
    """The OpenAI-compatible endpoint refused, failed or answered something unusable."""


class EngineStepError(RuntimeError):
    """An engine step raised; every answer in flight ends with this error (the engine goes on)."""


class ChatBackend(Protocol):
    """Streams the answer to a chat as text deltas."""

    name: str

    def stream(self, messages: list[dict[str, str]], max_tokens: int) -> AsyncIterator[str]:
        """Text deltas of the answer, as soon as each is decoded."""
        ...


PREFILL_PRIORITY = -1
"""Engine priority of the contexts `EngineChatBackend.prefill` opens while users speak: lower than
the answers' (0), so that a step's prefill budget goes to a prompt whose user waits first, and
KV pressure preempts a speaking user's context before an answer."""


class EngineChatBackend:
    """Our `LLMEngine`, shared by every session, stepped by one dedicated thread.

    The thread runs `engine.step()` while any sequence has work and routes each output to the
    asyncio queue of its request with `call_soon_threadsafe`.
    """

    name = "engine"

    def __init__(self, engine: Any, decode: DecodeSettings | None = None) -> None:
        self.engine = engine
        self.decode = decode or DECODE
        self._routes: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[tuple[str | Exception, bool]]]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.errors = 0
        self.last_error = ""
        self.healthy = True
        """False from a failed step until the next good step (an idle engine is probed with
        one-token requests, backing off to 1 s, so readiness comes back without traffic)."""
        self.recoveries_s: list[float] = []
        """Seconds from each failed step to the engine's recovery (readiness back)."""
        self._failed_at: float | None = None
        self._warm: dict[str, int] = {}
        import inspect

        takes_budget = "max_prefill_tokens" in inspect.signature(engine.step).parameters
        on_cpu = str(getattr(getattr(engine, "model", None), "device", "cpu")).startswith("cpu")
        self.step_prefill_tokens: int | None = 64 if on_cpu and takes_budget else None
        """Prefill tokens per engine step on CPU (≈ 0.1 s): an answer's prompt never waits long
        behind another session's prefill or this session's incremental one; None: the engine's."""
        self.prefills = 0
        """Open contexts started by `prefill` (incremental prefill while a user speaks)."""
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, model: str | None = None, device: str = "auto", quant: str = "auto",
             decode: DecodeSettings | None = None) -> EngineChatBackend:
        """Our engine for `model` (a GGUF file or Hugging Face folder; None: the embedded SmolLM2)
        through the one engine factory, warmed up."""
        from tristream.engine.cli_support import load_engine

        backend = cls(load_engine(model, device, quant), decode)
        backend.warm_up()
        return backend

    def warm_up(self) -> None:
        """One tiny generation on the caller's thread before any session streams (first-call costs).

        Only safe before the first `stream()`: the engine thread is idle until then.
        """
        from tristream.engine.sequence import SamplingParams
        from tristream.pipeline.prompt import SYSTEM_PROMPT

        if self._routes:
            return
        # with the default system prompt, so that its KV blocks sit in the prefix cache
        chat = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hi"}]
        self.engine.add_request(chat=chat, params=SamplingParams(max_tokens=2))
        while self.engine.has_work():
            self.engine.step()

    def _loop(self) -> None:
        probe_wait = 0.05
        while True:
            self._wake.wait(None if self._failed_at is None else probe_wait)
            self._wake.clear()
            if self._failed_at is not None and not self.engine.has_work():
                # Unhealthy and idle: a one-token probe tells when the engine works again.
                self._probe()
                probe_wait = min(1.0, 2 * probe_wait)
            else:
                probe_wait = 0.05
            backoff = 0.0
            while self.engine.has_work():
                try:
                    budget = self.step_prefill_tokens
                    outs = self.engine.step() if budget is None else self.engine.step(max_prefill_tokens=budget)
                except Exception as exc:  # keep the shared engine thread alive; requests see an error
                    self._on_step_error(exc)
                    backoff = min(1.0, max(0.01, 2 * backoff))
                    time.sleep(backoff)  # a persistent fault must not spin the thread
                    continue
                backoff = 0.0
                self._recovered()
                for o in outs:
                    self._deliver(o.seq_id, o.text, o.finished)

    def _probe(self) -> None:
        from tristream.engine.sequence import SamplingParams

        try:
            self.engine.add_request(chat=[{"role": "user", "content": "ping"}], params=SamplingParams(max_tokens=1))
        except Exception as exc:  # cannot even queue: stay unhealthy, try again later
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"

    def _on_step_error(self, exc: Exception) -> None:
        """Fail every request in flight with `EngineStepError` and cancel its sequence."""
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.healthy = False
        if self._failed_at is None:
            self._failed_at = time.monotonic()
        with self._lock:
            routes = list(self._routes)
        err = EngineStepError(f"the LLM engine failed during a step ({self.last_error}); "
                              "the answer was aborted, the engine recovers on its own")
        for seq_id in routes:
            self._deliver(seq_id, err, True)
            try:
                self.engine.cancel(seq_id)  # free its KV blocks so the engine can drain
            except Exception:
                self.errors += 1

    def _recovered(self) -> None:
        if self._failed_at is not None:
            self.recoveries_s.append(time.monotonic() - self._failed_at)
            self._failed_at = None
        self.healthy = True

    def _deliver(self, seq_id: int, text: str | Exception, finished: bool) -> None:
        with self._lock:
            route = self._routes.get(seq_id)
            if finished:
                self._routes.pop(seq_id, None)
        if route is not None:
            loop, q = route
            loop.call_soon_threadsafe(q.put_nowait, (text, finished))

    def prefill(self, key: str, messages: list[dict[str, str]] | None) -> None:
        """Prefill `messages` now in an open (non-generating) context for `key` (a session),
        replacing `key`'s previous one; None closes it.

        The replaced context's full KV blocks stay in the engine's prefix cache, so the next
        prompt of the same key (a longer partial, or the final turn through `stream`) computes
        only the positions after the first block that differs. A prompt the engine refuses
        (too long) is skipped: the answer is then prefilled whole, as without this call."""
        with self._lock:
            old = self._warm.pop(key, None)
            if old is not None:
                self.engine.cancel(old)
            if messages is not None:
                try:  # below every answer: an answer's prompt is prefilled first in each step
                    self._warm[key] = self.engine.add_request(chat=messages, generate=False, priority=PREFILL_PRIORITY)
                    self.prefills += 1
                except Exception:  # ContextTooLong, a tokenizer refusal: no warm context
                    self.errors += 1
        self._wake.set()

    async def stream(self, messages: list[dict[str, str]], max_tokens: int, params: Any = None,
                     prompt_ids: list[int] | None = None) -> AsyncIterator[str]:
        """Generate an answer to `messages`; cancelling the consumer cancels the sequence.

        ``params``: `SamplingParams` instead of the decode settings (a constrained tool call,
        `serve.tools`); ``prompt_ids``: the prompt as token ids instead of `messages` rendered."""
        params = params or self.decode.sampling(max_tokens)
        q: asyncio.Queue[tuple[str | Exception, bool]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            if prompt_ids is not None:
                seq_id = self.engine.add_request(prompt_ids, params=params)
            else:
                seq_id = self.engine.add_request(chat=messages, params=params)
            self._routes[seq_id] = (loop, q)
        self._wake.set()
        done = False
        try:
            while not done:
                text, done = await q.get()
                if isinstance(text, Exception):
                    raise text
                if text:
                    yield text
        finally:
            if not done:
                with self._lock:
                    self._routes.pop(seq_id, None)
                self.engine.cancel(seq_id)
                self._wake.set()


class OpenAIChatBackend:
    """Streaming chat completions from an OpenAI-compatible server (vLLM, SGLang, llama.cpp, Ollama).

    `url` is the API base, e.g. `http://127.0.0.1:8000/v1`; requests go to
    `{url}/chat/completions` with `stream: true` and are read as server-sent events.
    """

    name = "openai"

    def __init__(self, url: str, model: str = "default", api_key: str | None = None,
                 temperature: float = 0.0, timeout_s: float = 30.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.model = model
        self.temperature = temperature
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=5.0))
        self._httpx = httpx

    @property
    def endpoint(self) -> str:
        """The chat completions URL."""
        return self.url + "/chat/completions"

    async def stream(self, messages: list[dict[str, str]], max_tokens: int) -> AsyncIterator[str]:
        """POST the chat and yield `choices[0].delta.content` of each SSE event until [DONE]."""
        body = {"model": self.model, "messages": messages, "stream": True,
                "max_tokens": max_tokens, "temperature": self.temperature}
        try:
            async with self._client.stream("POST", self.endpoint, json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread())[:300].decode("utf-8", "replace")
                    raise LlmEndpointError(f"{self.endpoint} answered HTTP {resp.status_code}: {detail}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    try:
                        event = json.loads(payload)
                    except json.JSONDecodeError as e:
                        raise LlmEndpointError(f"{self.endpoint} sent a bad SSE event: {payload[:120]!r}") from e
                    for choice in event.get("choices", ()):
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            yield text
        except self._httpx.TransportError as e:
            raise LlmEndpointError(
                f"cannot reach the LLM endpoint {self.endpoint} ({type(e).__name__}: {e}); "
                "is the server running and does --llm-url include the /v1 prefix?"
            ) from e

    async def aclose(self) -> None:
        """Close the HTTP connection pool."""
        with contextlib.suppress(Exception):
            await self._client.aclose()
