"""The streaming interface every stage implements, and the events stages emit.

One model family per file (`vad.py`, `asr_whisper.py`, `asr_pocketsphinx.py`, `tts.py`,
`vision_cpu.py`); each splits into two objects:

- a **model** (`SileroVAD`, `WhisperASR`, `PocketsphinxASR`, `PiperTTS`, `EspeakTTS`,
  `SceneDescriber`): loaded once per process and shared by every session;
- a **stream** (`model.stream(session_id)`): per-session state behind one small interface,
  the idea of LiveKit Agents' `VADStream` without its asyncio coupling:

  ``push(item, ref_ns)``   give it input (audio samples, text, a frame); never blocks on I/O,
                          may run the model synchronously (call it from a worker thread);
  ``poll()``               drain the events produced so far (a list, oldest first);
  ``flush()``              end of input: finish pending work (last window, utterance,
                          sentence) so that the next ``poll()`` returns everything;
  ``close()``              free per-session state; further ``push`` raises `StageClosed`.

Streams are synchronous and single-threaded by design: the pipeline (asyncio) wraps each in a
task and runs ``push``/``flush`` in an executor; control packets (barge-in) call
``interrupt()`` where a stream has one (TTS) or ``flush()``/``close()`` otherwise.

Time: every event carries reference-clock nanoseconds derived from the audio's sample index
and the ``ref_ns`` of the chunk that sample came in (`SampleClock`), never from wall time, so
replaying a recording gives the same events. Events also say when the decision became
possible (``decided_ns``: the ref time of the last sample the model had seen), which is the
stage's algorithmic latency on the reference clock.

Audio convention: mono float32 in [-1, 1] (int16 accepted and converted), 16 kHz for VAD/ASR;
other rates go through `resample()`. Nothing is dropped silently: streams keep `counters`
(name -> count) for every discarded input, with the reason in the name.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from tristream.observe.events import AudioOut, SceneDescription, SpeechEvent, SpeechEventKind, Transcript

__all__ = [
    "AudioOut",
    "BadAudio",
    "ModelUnavailable",
    "SampleClock",
    "SceneDescription",
    "SpeechEvent",
    "SpeechEventKind",
    "StageClosed",
    "StageError",
    "Stream",
    "Transcript",
    "as_float_mono",
    "resample",
]

NS_PER_S = 1_000_000_000


class StageError(Exception):
    """Base class of every error raised by `tristream.stages`."""


class ModelUnavailable(StageError):
    """A model's files or runtime package are not installed; the message says what to install."""


class BadAudio(StageError, ValueError):
    """Audio input that a stage cannot use (wrong shape, rate, dtype or content)."""


class StageClosed(StageError):
    """`push` after `close()`."""


@dataclass(slots=True)
class SampleClock:
    """Maps a stream's running sample index to reference-clock ns through chunk anchors.

    Each pushed chunk adds an anchor (first sample index, ref_ns of that sample); a sample's
    time is its chunk's ref_ns plus its offset at the nominal rate, so clock jumps between
    chunks (drift compensation upstream) are honoured. Old anchors are pruned.
    """

    sample_rate: int
    keep: int = 4096
    _starts: deque[int] = field(default_factory=deque)
    _refs: deque[int] = field(default_factory=deque)
    total: int = 0

    def add(self, n: int, ref_ns: int) -> int:
        """Record a chunk of `n` samples starting at `ref_ns`; returns its first sample index."""
        first = self.total
        self._starts.append(first)
        self._refs.append(int(ref_ns))
        self.total += n
        while len(self._starts) > self.keep:
            self._starts.popleft()
            self._refs.popleft()
        return first

    def ns_at(self, sample_index: int) -> int:
        """Reference ns of `sample_index` (extrapolated from the nearest earlier anchor)."""
        if not self._starts:
            return sample_index * NS_PER_S // self.sample_rate
        i = bisect.bisect_right(self._starts, sample_index) - 1
        i = max(i, 0)
        start, ref = self._starts[i], self._refs[i]
        return ref + (sample_index - start) * NS_PER_S // self.sample_rate


def as_float_mono(pcm: np.ndarray) -> np.ndarray:
    """Return `pcm` as contiguous float32 mono in [-1, 1]; int16 is scaled, stereo averaged."""
    if not isinstance(pcm, np.ndarray):
        raise BadAudio(f"audio must be a numpy array, got {type(pcm).__name__}")
    if pcm.ndim == 2:
        pcm = pcm.mean(axis=1) if pcm.shape[1] <= 8 else pcm.mean(axis=0)
    if pcm.ndim != 1:
        raise BadAudio(f"audio shape {pcm.shape}; expected (n,) or (n, channels)")
    if pcm.dtype == np.int16:
        return (pcm.astype(np.float32) / 32768.0).astype(np.float32)
    if pcm.dtype.kind != "f":
        raise BadAudio(f"audio dtype {pcm.dtype}; expected float32 in [-1, 1] or int16")
    return np.ascontiguousarray(pcm, dtype=np.float32)


def resample(pcm: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """High-quality resampling of a whole mono clip (float32 or int16, soxr); identity when rates match."""
    if rate_in == rate_out:
        return pcm
    if rate_in <= 0 or rate_out <= 0:
        raise BadAudio(f"sample rates must be positive, got {rate_in} -> {rate_out}")
    import soxr

    if pcm.dtype == np.int16:  # in float: soxr dithers integer output (run to run, not reproducible)
        y = soxr.resample(pcm.astype(np.float32), rate_in, rate_out, quality="HQ")
        return _to_int16(y)
    return np.asarray(soxr.resample(pcm, rate_in, rate_out, quality="HQ"), dtype=np.float32)


def _to_int16(y: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(y), -32768, 32767).astype(np.int16)


class Resampler:
    """Streaming resampling of one mono stream, chunk by chunk (soxr, state kept across chunks).

    The one place a live stream changes rate: client audio into a session (to `SPEECH_RATE`)
    and answer audio out to the client. A chunk's output may be a few ms shorter than its
    input at first (the filter's delay); `flush` returns the tail at the end of a stream.
    About 11 µs per 20 ms chunk (24 → 16 kHz, int16).
    """

    def __init__(self, rate_in: int, rate_out: int, dtype: type = np.int16) -> None:
        if rate_in <= 0 or rate_out <= 0:
            raise BadAudio(f"sample rates must be positive, got {rate_in} -> {rate_out}")
        self.rate_in, self.rate_out, self.dtype = rate_in, rate_out, np.dtype(dtype)
        self._stream: Any = self._new_stream()

    def _new_stream(self) -> Any:
        """A fresh soxr stream, or None where the rates match."""
        if self.rate_in == self.rate_out:
            return None
        import soxr

        # float inside: soxr dithers integer output, which would make replays differ
        return soxr.ResampleStream(self.rate_in, self.rate_out, 1, dtype="float32", quality="HQ")

    def _out(self, y: np.ndarray) -> np.ndarray:
        return _to_int16(y) if self.dtype == np.int16 else np.asarray(y, dtype=np.float32)

    def push(self, pcm: np.ndarray) -> np.ndarray:
        """The resampled audio this chunk completes."""
        if self._stream is None:
            return np.ascontiguousarray(pcm, dtype=self.dtype)
        return self._out(self._stream.resample_chunk(np.ascontiguousarray(pcm, dtype=np.float32)))

    def flush(self) -> np.ndarray:
        """The stream's remaining output (the filter's tail); the resampler starts afresh after it."""
        if self._stream is None:
            return np.zeros(0, self.dtype)
        tail = self._out(self._stream.resample_chunk(np.zeros(0, np.float32), last=True))
        self._stream = self._new_stream()
        return tail


InT = TypeVar("InT")
EvT = TypeVar("EvT")


class Stream(Generic[InT, EvT]):
    """Per-session streaming state of a stage: push input, poll events, flush, close."""

    session_id: str

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.counters: dict[str, int] = {}
        self._events: list[EvT] = []
        self._closed = False

    def push(self, item: InT, ref_ns: int) -> None:
        """Give the stream input whose first element was captured at `ref_ns`."""
        raise NotImplementedError

    def flush(self) -> None:
        """End of input: finish pending work so that `poll()` returns every event."""

    def poll(self) -> list[EvT]:
        """Drain and return the events produced since the last call, oldest first."""
        out, self._events = self._events, []
        return out

    def close(self) -> None:
        """Release per-session state; later `push` calls raise `StageClosed`."""
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _check_open(self) -> None:
        if self._closed:
            raise StageClosed(f"stream {self.session_id!r} of {type(self).__name__} is closed")
