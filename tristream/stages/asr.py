"""Utterance-level streaming ASR: VAD events cut the audio, a recogniser turns it into text.

`UtteranceStream` is the ASR stage's stream for any engine (`asr_whisper`, `asr_pocketsphinx`).
It takes two kinds of input on `push`: audio chunks (the *same* 16 kHz chunks, in the same
order, that the session's `VADStream` gets, so that sample indices agree) and that VAD's
`SpeechEvent`s. On START it opens an utterance from the event's sample index minus
`preroll_s` (audio kept in a short ring); while speaking it feeds audio and, every
`partial_every_s` of new speech, emits a partial `Transcript`; on END it feeds audio up to the
end edge plus `postroll_s` and emits the final `Transcript`.

A recogniser is a factory of per-utterance decoders (`Recognizer.utterance()`), so engines that
decode incrementally (pocketsphinx) and engines that decode a whole clip (Whisper) share this
stream.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Protocol

import numpy as np

from tristream.observe.events import FailedTranscript, SpeechEvent, SpeechEventKind, Transcript
from tristream.stages.base import SampleClock, Stream, as_float_mono

log = logging.getLogger("tristream.asr")

__all__ = ["Recognizer", "UtteranceDecoder", "UtteranceStream", "transcribe_offline"]

SAMPLE_RATE = 16_000


class UtteranceDecoder(Protocol):
    """Decodes one utterance: feed audio, ask for a partial, finish with the final text."""

    def feed(self, pcm: np.ndarray) -> None:
        """Add 16 kHz float32 mono audio of this utterance."""
        ...

    def partial(self) -> str:
        """Best text so far (may cost a decode of the audio fed so far)."""
        ...

    def final(self) -> str:
        """Finish the utterance and return its text."""
        ...

    # Optional: `abort()` releases resources without decoding (called by `UtteranceStream.cancel`).


class Recognizer(Protocol):
    """A loaded ASR model shared by sessions."""

    name: str

    def utterance(self) -> UtteranceDecoder:
        """A fresh decoder for one utterance."""
        ...


class UtteranceStream(Stream[np.ndarray | SpeechEvent, Transcript]):
    """Per-session ASR: audio + VAD events in, partial and final transcripts out."""

    def __init__(self, recognizer: Recognizer, session_id: str, partial_every_s: float | None = 1.0,
                 preroll_s: float = 0.2, postroll_s: float = 0.15, ring_s: float = 3.0,
                 max_utterance_s: float = 25.0) -> None:
        super().__init__(session_id)
        self.recognizer = recognizer
        self.clock = SampleClock(SAMPLE_RATE)
        self.partial_every = int(partial_every_s * SAMPLE_RATE) if partial_every_s else None
        self.preroll = int(preroll_s * SAMPLE_RATE)
        self.postroll = int(postroll_s * SAMPLE_RATE)
        self._ring_len = int(ring_s * SAMPLE_RATE)
        self.max_utterance = int(max_utterance_s * SAMPLE_RATE)
        self._ring = np.zeros(0, dtype=np.float32)
        self._ring_start = 0  # sample index of _ring[0]
        self._decoder: UtteranceDecoder | None = None
        self._fed_to = 0  # next sample index to feed the decoder
        self._utt_start = 0
        self._since_partial = 0
        self._pending_end: SpeechEvent | None = None
        self._last_partial = ""

    @property
    def decoder(self) -> UtteranceDecoder | None:
        """The open utterance's decoder (None between utterances)."""
        return self._decoder

    @property
    def in_utterance(self) -> bool:
        """Whether an utterance is open (between VAD START and the final transcript)."""
        return self._decoder is not None

    def push(self, item: np.ndarray | SpeechEvent, ref_ns: int = 0) -> None:
        """Give audio (with its `ref_ns`) or a `SpeechEvent` from this session's VAD."""
        self._check_open()
        if isinstance(item, SpeechEvent):
            self._on_event(item)
            return
        pcm = as_float_mono(item)
        self.clock.add(pcm.shape[0], ref_ns)
        self._ring = np.concatenate([self._ring, pcm])
        if self._decoder is not None:
            if self._pending_end is None and self.clock.total - self._utt_start >= self.max_utterance:
                self._split_long_utterance()
            self._feed_available()
            if self._pending_end is not None and self.clock.total >= self._end_target(self._pending_end):
                self._finish(self._pending_end)
        excess = self._ring.shape[0] - self._ring_len
        if excess > 0 and self._decoder is None:
            self._ring = self._ring[excess:]
            self._ring_start += excess

    def flush(self) -> None:
        """End of input: finish an open utterance with the audio there is."""
        if self._decoder is None or self._closed:
            return
        end = self._pending_end
        if end is None:
            self._count("utterance_closed_by_flush")
            end = SpeechEvent(self.session_id, SpeechEventKind.END, self.clock.ns_at(self.clock.total),
                              self.clock.ns_at(self.clock.total), self.clock.total, 0.0)
        self._finish(end, force=True)

    def cancel(self) -> None:
        """Drop an open utterance without a final (e.g. the pipeline discards the turn)."""
        if self._decoder is not None:
            self._count("utterances_cancelled")
            abort = getattr(self._decoder, "abort", None)
            if abort is not None:
                abort()
        self._decoder = None
        self._pending_end = None

    def _on_event(self, ev: SpeechEvent) -> None:
        if ev.kind == SpeechEventKind.START:
            if self._decoder is not None:
                self._count("start_while_in_utterance")
                return
            start = max(ev.sample_index - self.preroll, self._ring_start)
            if ev.sample_index - self.preroll < self._ring_start:
                self._count("preroll_samples_missing", self._ring_start - (ev.sample_index - self.preroll))
            self._open(start)
            self._last_partial = ""
            self._feed_available()
        elif self._decoder is None:
            self._count("end_without_start")
        elif self.clock.total >= self._end_target(ev):
            self._finish(ev)
        else:
            self._pending_end = ev

    def _split_long_utterance(self) -> None:
        # Whisper sees at most 30 s: close this piece where the audio is now, go on in a new one
        self._count("utterances_split_at_max_length")
        at = self.clock.total
        ev = SpeechEvent(self.session_id, SpeechEventKind.END, self.clock.ns_at(at), self.clock.ns_at(at), at, 1.0)
        self._finish(ev, force=True, postroll=False)
        self._open(at)

    def _open(self, at: int) -> None:
        """A new utterance whose audio starts at sample `at`."""
        self._decoder = self.recognizer.utterance()
        self._utt_start = at
        self._fed_to = at
        self._since_partial = 0

    def _end_target(self, ev: SpeechEvent) -> int:
        return ev.sample_index + self.postroll

    def _feed_available(self, upto: int | None = None) -> None:
        assert self._decoder is not None
        stop = self.clock.total if upto is None else min(upto, self.clock.total)
        if stop <= self._fed_to:
            return
        a = self._fed_to - self._ring_start
        b = stop - self._ring_start
        self._decoder.feed(self._ring[a:b])
        self._since_partial += stop - self._fed_to
        self._fed_to = stop
        if upto is None and self.partial_every and self._since_partial >= self.partial_every:
            self._since_partial = 0
            t0 = time.perf_counter()
            text = self._decoder.partial()
            dt = time.perf_counter() - t0
            if text == self._last_partial:
                return
            self._last_partial = text
            self._events.append(Transcript(self.session_id, text, False, self.clock.ns_at(self._utt_start),
                                           self.clock.ns_at(stop), self.clock.ns_at(stop), dt))

    def _finish(self, ev: SpeechEvent, force: bool = False, postroll: bool = True) -> None:
        assert self._decoder is not None
        target = self._end_target(ev) if postroll else ev.sample_index
        if not force and self.clock.total < target:
            self._pending_end = ev
            return
        if self._fed_to < target:
            self._feed_available(target)
        t0 = time.perf_counter()
        error = ""
        try:
            text = self._decoder.final()
        except Exception as exc:  # the utterance is lost, the stream is not: a final that says why
            self._count("finals_failed")
            log.warning("asr final failed in session %s: %s: %s", self.session_id, type(exc).__name__, exc)
            text, error = "", f"{type(exc).__name__}: {exc}"
            abort = getattr(self._decoder, "abort", None)
            if abort is not None:
                with contextlib.suppress(Exception):
                    abort()
        dt = time.perf_counter() - t0
        decided = max(ev.decided_ns, self.clock.ns_at(min(target, self.clock.total)))
        start = self.clock.ns_at(self._utt_start)
        self._events.append(
            FailedTranscript(self.session_id, text, True, start, ev.t_ns, decided, dt, error) if error
            else Transcript(self.session_id, text, True, start, ev.t_ns, decided, dt))
        self._decoder = None
        self._pending_end = None
        # keep only the ring tail: the next utterance needs at most its preroll
        keep_from = max(self.clock.total - self._ring_len, self._ring_start)
        self._ring = self._ring[keep_from - self._ring_start:]
        self._ring_start = keep_from


def transcribe_offline(pcm: np.ndarray, vad_stream: Stream, asr_stream: UtteranceStream,
                       chunk_ms: float = 20.0, t0_ns: int = 0) -> list[Transcript]:
    """Run a whole 16 kHz clip through a VAD stream and an ASR stream as if it were live.

    Chunks of `chunk_ms` go to both streams in capture order (ref time from the sample index
    plus `t0_ns`), VAD events follow their chunk; returns every transcript (partials too).
    """
    n = max(int(chunk_ms * SAMPLE_RATE / 1000), 1)
    out: list[Transcript] = []
    for i in range(0, pcm.shape[0], n):
        chunk = pcm[i:i + n]
        ref = t0_ns + i * 1_000_000_000 // SAMPLE_RATE
        vad_stream.push(chunk, ref)
        asr_stream.push(chunk, ref)
        for ev in vad_stream.poll():
            asr_stream.push(ev)
        out.extend(asr_stream.poll())
    vad_stream.flush()
    for ev in vad_stream.poll():
        asr_stream.push(ev)
    asr_stream.flush()
    out.extend(asr_stream.poll())
    return out
