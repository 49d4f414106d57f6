"""Speculative ASR final: decode while the VAD is still waiting out its hangover.

Whisper decodes a whole utterance at its end (≈ 0.25 s for 2 s of speech on 2 cores), and
the VAD only ends the utterance after `hangover_ms` of silence. Both waits add up on the
answer's critical path. Here the utterance is decoded as soon as the user has been silent
for `after_ms` (the input stage sends a `SilenceOnset` marker in order with the audio), in a
worker thread, while the hangover runs. If the user stays silent the VAD's END arrives and
`final()` returns the speculative text (waiting for it if still running); if the user speaks
again (`SpeechResumed`) the speculation is dropped and `final()` decodes as usual. Only
trailing silence separates the two audio spans, so the text is the one a late decode would
give; `hits`/`misses` count how often the speculation was used.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import numpy as np


class SpeculativeRecognizer:
    """Wraps a recognizer with a `transcribe(pcm)` method; one per session (tracks its utterance)."""

    def __init__(self, inner: Any, max_extra_s: float = 1.0) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", "asr")
        self.max_extra = int(max_extra_s * 16_000)
        self.current: SpeculativeUtterance | None = None
        self.hits = 0
        self.misses = 0
        self.started = 0
        self.dropped = 0

    def utterance(self) -> SpeculativeUtterance:
        """A decoder for one utterance (the inner one, plus a copy of its audio for speculation)."""
        u = SpeculativeUtterance(self, self.inner.utterance())
        self.current = u
        return u


class SpeculativeUtterance:
    """Feeds the inner decoder and keeps the audio; `final()` may return the speculative text."""

    def __init__(self, owner: SpeculativeRecognizer, inner: Any) -> None:
        self.owner = owner
        self.inner = inner
        self._parts: list[np.ndarray] = []
        self.n = 0
        self._spec: concurrent.futures.Future[tuple[int, str]] | None = None

    def feed(self, pcm: np.ndarray) -> None:
        """Add audio (event-loop thread)."""
        self.inner.feed(pcm)
        self._parts.append(pcm)
        self.n += int(pcm.shape[0])

    def partial(self) -> str:
        """The inner decoder's partial."""
        return str(self.inner.partial())

    @property
    def speculating(self) -> bool:
        """Whether a speculation was started and not dropped."""
        return self._spec is not None

    def speculate(self, pool: concurrent.futures.Executor) -> None:
        """Decode the audio fed so far in `pool` (called on `SilenceOnset`)."""
        if self._spec is not None or not self._parts:
            return
        parts = list(self._parts)
        n = self.n
        transcribe = self.owner.inner.transcribe
        self.owner.started += 1

        def run() -> tuple[int, str]:
            return n, str(transcribe(np.concatenate(parts)))

        self._spec = pool.submit(run)

    def drop(self) -> None:
        """The user spoke again: the speculation no longer covers the utterance."""
        if self._spec is not None:
            self._spec.cancel()
            self._spec = None
            self.owner.dropped += 1

    def final(self) -> str:
        """The speculative text when it covers the utterance up to trailing silence; else a decode."""
        spec = self._spec
        if spec is not None and not spec.cancelled():
            n, text = spec.result()
            if self.n - n <= self.owner.max_extra:
                self.owner.hits += 1
                abort = getattr(self.inner, "abort", None)
                if abort is not None:
                    abort()
                return text
        self.owner.misses += 1
        return str(self.inner.final())
