"""Per-session ASR stream over the shared `BatchedWhisperASR` (`asr_batched`): partials, timed finals.

`BatchedUtteranceStream` keeps `UtteranceStream`'s preroll / postroll / VAD-event handling (it
subclasses it) with a decoder that streams into the batcher. Hypotheses arrive asynchronously from
the batcher thread and come out of `poll()` as partial `Transcript`s (committed words only, so each
extends the previous); the final is a `TimedTranscript`: each word with its start / end on the
reference clock and in ms of the session's audio (the axis of ``audio_start_ms``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tristream.observe.events import Transcript
from tristream.stages.asr import SAMPLE_RATE, UtteranceStream
from tristream.stages.asr_batched import BatchedWhisperASR

__all__ = ["BatchedUtteranceStream", "TimedTranscript", "WordTime"]

_keys = itertools.count()


@dataclass(slots=True, frozen=True)
class WordTime:
    """One word of a final transcript: reference-clock ns and ms into the session's audio."""

    text: str
    start_ns: int
    end_ns: int
    start_ms: int
    end_ms: int


@dataclass(slots=True, frozen=True)
class TimedTranscript(Transcript):
    """A `Transcript` with its words' times (finals of `BatchedUtteranceStream`)."""

    words: tuple[WordTime, ...] = ()


def _text(words: list[Any]) -> str:
    return "".join(w.text for w in words).strip()


class _BatchedDecoder:
    """One utterance of a `BatchedUtteranceStream`, streamed into the shared batcher."""

    def __init__(self, stream: BatchedUtteranceStream) -> None:
        self.stream = stream
        self.key = f"{stream.session_id}#{next(_keys)}"
        self.opened = False
        self.start_sample = 0
        self.t0_ns = 0

    def feed(self, pcm: np.ndarray) -> None:
        s = self.stream
        if not self.opened:
            self.opened = True
            self.start_sample = s._utt_start
            self.t0_ns = s.clock.ns_at(s._utt_start)
            s.asr.open(self.key, self.t0_ns, self._on_update)
        s.asr.feed(self.key, pcm)

    def _on_update(self, committed: list[Any], partial: list[Any], pass_s: float) -> None:
        # committed words only: they never change, so every partial extends the previous one
        # (the protocol's deltas are increments); the final adds the last unconfirmed words
        self.stream._partial(self, _text(committed), pass_s)

    def partial(self) -> str:
        return self.stream._last_partial

    def final(self) -> str:
        s = self.stream
        if not self.opened:
            return ""
        t0 = time.perf_counter()
        try:
            words = s.asr.finish(self.key).result(timeout=s.asr.final_timeout_s)
        except concurrent.futures.TimeoutError:
            s._count("final_timeout")
            s.asr.abort(self.key)
            return s._last_partial
        s._final_s = time.perf_counter() - t0
        s._final_words = tuple(self._word_time(w) for w in words)
        return _text(words)

    def _word_time(self, w: Any) -> WordTime:
        base_ms = self.start_sample * 1000 // SAMPLE_RATE
        return WordTime(w.text.strip(), int(w.start_ns), int(w.end_ns),
                        base_ms + (int(w.start_ns) - self.t0_ns) // 1_000_000,
                        base_ms + (int(w.end_ns) - self.t0_ns) // 1_000_000)

    def abort(self) -> None:
        if self.opened:
            self.stream.asr.abort(self.key)


class _Recognizer:
    """`UtteranceStream`'s recognizer: makes this stream's batched decoders."""

    name = BatchedWhisperASR.name

    def __init__(self, stream: BatchedUtteranceStream) -> None:
        self.stream = stream

    def utterance(self) -> _BatchedDecoder:
        d = _BatchedDecoder(self.stream)
        self.stream._current = d
        self.stream._last_partial = ""
        return d


class BatchedUtteranceStream(UtteranceStream):
    """Per-session ASR over the shared batcher: asynchronous partials, timed finals (module docstring)."""

    def __init__(self, asr: BatchedWhisperASR, session_id: str) -> None:
        super().__init__(_Recognizer(self), session_id, partial_every_s=None)
        self.asr = asr
        self._lock = threading.Lock()
        self._async: list[Transcript] = []
        self._current: _BatchedDecoder | None = None
        self._last_partial = ""
        self._final_words: tuple[WordTime, ...] = ()
        self._final_s = 0.0

    def _partial(self, dec: _BatchedDecoder, text: str, pass_s: float) -> None:
        """Batcher thread: a new hypothesis of utterance ``dec``."""
        if dec is not self._current or not text or text == self._last_partial:
            return
        self._last_partial = text
        now = self.clock.ns_at(self.clock.total)
        with self._lock:
            self._async.append(Transcript(self.session_id, text, False, dec.t0_ns, now, now, pass_s))
            self.counters["partials"] = self.counters.get("partials", 0) + 1

    def poll(self) -> list[Transcript]:
        """Partials from the batcher (oldest first), then finals."""
        with self._lock:
            out, self._async = self._async, []
        out.extend(super().poll())
        return out

    def _finish(self, ev: Any, force: bool = False, postroll: bool = True) -> None:
        n = len(self._events)
        super()._finish(ev, force, postroll)
        if len(self._events) > n and self._events[-1].final:  # attach the words to the final
            tr = self._events[-1]
            self._events[-1] = TimedTranscript(tr.session_id, tr.text, True, tr.start_ns, tr.end_ns, tr.decided_ns,
                                               self._final_s, self._final_words)
            self._final_words = ()
            self._current = None

    def close(self) -> None:
        """Drop an open utterance (no final) and close the stream."""
        if not self._closed:
            self.cancel()
        super().close()
