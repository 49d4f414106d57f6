"""Proxies `PipelineBackend` puts at the pipeline session's seams (it has no event callbacks):
stream taps (VAD, ASR), a chat proxy (answer text, engine failures) and the audio sink."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np


class StreamTap:
    """Forwards every attribute to the wrapped stream; intercepts ``poll`` results."""

    def __init__(self, inner: Any, on_events: Any) -> None:
        self._inner = inner
        self._on_events = on_events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def poll(self) -> list[Any]:
        evs = list(self._inner.poll())
        if evs:
            self._on_events(evs)
        return evs


class TappedChat:
    """A `ChatBackend` proxy that reports each text delta."""

    def __init__(self, inner: Any, on_delta: Any, on_error: Any = None) -> None:
        self._inner = inner
        self._on_delta = on_delta
        self._on_error = on_error
        self.name = getattr(inner, "name", "llm")

    async def stream(self, messages: list[dict[str, str]], max_tokens: int) -> AsyncIterator[str]:
        gen = self._inner.stream(messages, max_tokens)
        try:
            async for d in gen:
                self._on_delta(d)
                yield d
        except Exception as exc:  # the engine failed: the answer ends as "failed" (an error event)
            if self._on_error is not None:
                self._on_error(exc)
            raise
        finally:
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                await aclose()


class EventAudioSink:
    """The session's audio sink: answer audio becomes `AudioDelta` events."""

    def __init__(self, backend: Any) -> None:
        self.b = backend

    def write(self, pcm: np.ndarray, sample_rate: int) -> None:
        self.b._on_audio(pcm, sample_rate)

    def interrupt(self) -> None:
        self.b._count("sink_interrupts")
