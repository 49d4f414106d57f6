"""What the server needs from a session's brain: the `SessionBackend` protocol and its events.

The WebSocket layer knows nothing about models. Each connection owns one backend object
(made by a `BackendFactory`), pushes decoded inputs into it and forwards the backend's
events to the client as Realtime API events. The assistant pipeline (VAD -> ASR -> LLM ->
TTS with barge-in) implements this protocol through an adapter; `EchoBackend` implements it
without models for protocol tests and load tests of the serving layer itself.

Time: every input carries the server's reference time (``ref_ns``, monotonic) at which it
arrived, plus the client's capture timestamp where the client sent one; backends stamp
their events with reference time, so the server can compute latencies and the recorder
can replay a session on a virtual clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tristream.observe.events import EncodedFrame, EventSink, ResponseDone
from tristream.serve.metrics import Family


@dataclass(slots=True)
class BackendConfig:
    """Session settings a backend acts on (a view of `SessionSettings`)."""

    instructions: str
    modalities: list[str]
    sample_rate: int = 16_000
    output_sample_rate: int = 24_000
    vad: bool = True
    vad_threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    eagerness: str | None = None
    """``semantic_vad``'s eagerness (None: ``server_vad``, the silence rule alone)."""
    create_response: bool = True
    interrupt_response: bool = True
    tier: str = "silver"
    """SLA tier (gold / silver / bronze) for backends that schedule turns (``--backend engine``)."""


class SessionBackend(Protocol):
    """One session's assistant. Push methods never block the event loop for long.

    Events go to the ``sink`` given at ``start``; the sink may be called from the loop
    thread only (backends that compute in worker threads hop back with
    ``loop.call_soon_threadsafe``).
    """

    async def start(self, config: BackendConfig, sink: EventSink) -> None:
        """Prepare per-session state; events flow to ``sink`` from now on."""
        ...

    def update(self, config: BackendConfig) -> None:
        """Apply a ``session.update``."""
        ...

    def push_audio(self, pcm: np.ndarray, ref_ns: int, capture_ts_us: int | None) -> None:
        """int16 mono samples at ``config.sample_rate``."""
        ...

    def push_frame(self, frame: EncodedFrame) -> None:
        """One camera frame for the aligner."""
        ...

    def push_text(self, role: str, text: str, images: list[bytes], ref_ns: int) -> None:
        """A conversation item (text, optional images) from the client."""
        ...

    def commit_audio(self, ref_ns: int) -> None:
        """End the user's audio turn by hand."""
        ...

    def clear_audio(self, ref_ns: int) -> None:
        """Drop buffered, uncommitted audio."""
        ...

    def create_response(self, instructions: str | None, ref_ns: int, modalities: list[str] | None = None) -> None:
        """Answer now; ``modalities``: this answer's output modalities (None: the session's). An answer
        without ``audio`` is not synthesised at all."""
        ...

    def cancel_response(self, ref_ns: int) -> None:
        """Stop the answer in progress (a ``ResponseDone(status='cancelled')`` follows)."""
        ...

    def counters(self) -> dict[str, int]:
        """Named counters (drops with reasons included) for metrics."""
        ...

    async def close(self) -> None:
        """Finish: free resources; no event after this returns."""
        ...


BackendFactory = Callable[[], SessionBackend]
"""Makes one `SessionBackend` per session (a plain function, or a `BackendFamily`)."""


class TextTurnBackend:
    """What the text-turn engine backends share: the sink, counters of the inputs they ignore
    (audio, frames), one answer task at a time and its cancellation. Subclasses answer in
    ``create_response``; ``_stop_answer`` frees the engine's side of a cancelled answer."""

    def __init__(self) -> None:
        self.sink: EventSink | None = None
        self._task: asyncio.Task[None] | None = None
        self._counters: dict[str, int] = {}

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _emit(self, ev: Any) -> None:
        if self.sink is not None:
            self.sink(ev)

    def push_audio(self, pcm: np.ndarray, ref_ns: int, capture_ts_us: int | None) -> None:
        """No speech models in a text-turn backend: counted."""
        self._count("ignored_audio_chunks")

    def push_frame(self, frame: EncodedFrame) -> None:
        """No vision in a text-turn backend: counted."""
        self._count("ignored_frames")

    def clear_audio(self, ref_ns: int) -> None:
        """No audio buffer."""

    def _stop_answer(self) -> None:
        """Free what the engine holds for the answer in flight (the task is cancelled after)."""

    def cancel_response(self, ref_ns: int) -> None:
        """Stop the answer in flight (a cancelled `ResponseDone` follows)."""
        if self._task is not None:
            self._stop_answer()
            self._task.cancel()
            self._task = None
            self._emit(ResponseDone("cancelled", time.monotonic_ns()))

    def counters(self) -> dict[str, int]:
        """Ignored inputs (and what a subclass counts), by kind."""
        return dict(self._counters)

    async def close(self) -> None:
        """Cancel an answer in flight; no event after this."""
        self.cancel_response(time.monotonic_ns())
        self.sink = None


def _no_families() -> list[Family]:
    return []


def _healthy() -> bool:
    return True


@dataclass(slots=True)
class BackendFamily:
    """A backend family loaded once per process: ``make`` builds each session's backend; the rest
    is what the server asks of the family as a whole.

    ``collect``: process-wide metric families for ``/metrics`` (totals of closed sessions, the
    scheduler's, the shared recogniser's); ``healthy``: False fails ``/health`` (the engine thread
    died, the LLM endpoint is down); ``chat_llm``: the engine ``/v1/chat/completions`` answers on;
    ``engine``: the engine the sessions share (`ScheduledEngine` or `AsyncLLM`); ``scheduler``: its
    `Scheduler`, whose pressure the scale router balances on; ``asr``: the shared recogniser, for
    its stats and shutdown.
    """

    make: Callable[[], SessionBackend]
    collect: Callable[[], list[Family]] = _no_families
    healthy: Callable[[], bool] = _healthy
    chat_llm: Any = None
    engine: Any = None
    scheduler: Any = None
    asr: Any = None

    def __call__(self) -> SessionBackend:
        return self.make()


def family_of(factory: BackendFactory) -> BackendFamily:
    """``factory`` as a `BackendFamily` (a plain function has no metrics, health or shared parts)."""
    return factory if isinstance(factory, BackendFamily) else BackendFamily(factory)
