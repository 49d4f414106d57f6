"""`EchoBackend`: a model-free `SessionBackend` for protocol tests and serving-layer benchmarks.

It does real turn-taking on the audio it gets (an energy VAD over 20 ms frames with the
session's silence duration), "transcribes" a turn as ``"speech <N> ms"`` (N = voiced
length, rounded to 20 ms; deterministic, so tests can check that every client got its
own transcript) and answers with text (``"echo: <transcript>"``) plus the user's own
turn audio played back at the output rate. Answers stream chunk by chunk as an asyncio
task (pace 0 = as fast as the loop allows, 1 = real time), so barge-in and
``response.cancel`` have something to interrupt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from tristream.observe.events import (
    AnswerAudio,
    AnswerText,
    EncodedFrame,
    EventSink,
    ResponseDone,
    ResponseStarted,
    SpeechStarted,
    SpeechStopped,
    TranscriptDelta,
    TranscriptDone,
)
from tristream.serve.backend import BackendConfig
from tristream.stages.base import resample

FRAME_MS = 20
CHUNK_MS = 100


class EchoBackend:
    """Energy-VAD turn-taking + echo answers; see the module docstring."""

    def __init__(self, pace: float = 0.0, sleep: Callable[[float], Awaitable[None]] | None = None) -> None:
        self.pace = pace
        self._sleep = sleep or asyncio.sleep
        self._cfg: BackendConfig | None = None
        self._sink: EventSink | None = None
        self._pending = np.zeros(0, dtype=np.int16)
        self._samples_in = 0
        self._in_speech = False
        self._speech_start = 0
        self._silence_frames = 0
        self._voiced_frames = 0
        self._turn: list[np.ndarray] = []
        self._last_turn: np.ndarray = np.zeros(0, dtype=np.int16)
        self._last_text = ""
        self._texts: list[str] = []
        self._images = 0
        self._frames = 0
        self._task: asyncio.Task[None] | None = None
        self._counters: dict[str, int] = {}

    # -- protocol
    async def start(self, config: BackendConfig, sink: EventSink) -> None:
        """Keep the config and sink."""
        self._cfg = config
        self._sink = sink

    def update(self, config: BackendConfig) -> None:
        """New settings apply from the next frame on."""
        self._cfg = config

    def _emit(self, ev: object) -> None:
        assert self._sink is not None
        self._sink(ev)  # type: ignore[arg-type]

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def push_audio(self, pcm: np.ndarray, ref_ns: int, capture_ts_us: int | None) -> None:
        """Run the energy VAD over whole 20 ms frames; keep the remainder for the next push."""
        cfg = self._cfg
        assert cfg is not None
        self._count("audio_samples_in", int(pcm.size))
        buf = np.concatenate([self._pending, pcm]) if self._pending.size else pcm
        flen = cfg.sample_rate * FRAME_MS // 1000
        nfr = buf.size // flen
        self._pending = buf[nfr * flen:].copy()
        if nfr == 0:
            return
        frames = buf[: nfr * flen].reshape(nfr, flen).astype(np.float32) / 32768.0
        rms = np.sqrt(np.mean(frames * frames, axis=1))
        # threshold 0.5 (OpenAI's default) -> RMS 0.02 (about -34 dBFS).
        voiced = rms > 0.04 * cfg.vad_threshold
        silence_needed = max(1, cfg.silence_duration_ms // FRAME_MS)
        for i in range(nfr):
            frame_start = self._samples_in + i * flen
            if self._in_speech:
                self._turn.append(buf[i * flen:(i + 1) * flen])
                if voiced[i]:
                    self._silence_frames = 0
                    self._voiced_frames += 1
                else:
                    self._silence_frames += 1
                    if cfg.vad and self._silence_frames >= silence_needed:
                        self._end_turn(frame_start + flen, ref_ns)
            elif voiced[i]:
                self._in_speech = True
                self._speech_start = frame_start
                self._silence_frames = 0
                self._voiced_frames = 1
                self._turn = [buf[i * flen:(i + 1) * flen]]
                if self._task is not None and not self._task.done() and cfg.interrupt_response:
                    self.cancel_response(ref_ns)
                if cfg.vad:
                    self._emit(SpeechStarted(self._ms(frame_start), ref_ns))
        self._samples_in += nfr * flen

    def _ms(self, sample: int) -> int:
        assert self._cfg is not None
        return sample * 1000 // self._cfg.sample_rate

    def _end_turn(self, end_sample: int, ref_ns: int, manual: bool = False) -> None:
        assert self._cfg is not None
        self._in_speech = False
        if not manual:
            self._emit(SpeechStopped(self._ms(end_sample), ref_ns))
        self._last_turn = np.concatenate(self._turn) if self._turn else np.zeros(0, dtype=np.int16)
        self._turn = []
        text = f"speech {self._voiced_frames * FRAME_MS} ms"
        self._emit(TranscriptDelta(text, ref_ns))
        self._emit(TranscriptDone(text, ref_ns))
        self._last_text = text
        if manual or self._cfg.create_response:
            self.create_response(None, ref_ns)

    def push_frame(self, frame: EncodedFrame) -> None:
        """Count frames; the echo answer says how many arrived."""
        self._frames += 1
        self._count("video_frames_in")

    def push_text(self, role: str, text: str, images: list[bytes], ref_ns: int) -> None:
        """Remember the text; it is echoed by the next answer."""
        self._texts.append(text)
        self._images += len(images)
        self._last_turn = np.zeros(0, dtype=np.int16)

    def commit_audio(self, ref_ns: int) -> None:
        """Manual end of turn: whatever is buffered becomes the turn."""
        if self._in_speech:
            self._end_turn(self._samples_in, ref_ns, manual=True)
        else:
            self.create_response(None, ref_ns)

    def clear_audio(self, ref_ns: int) -> None:
        """Forget the open turn and the remainder."""
        self._count("audio_samples_cleared", int(self._pending.size) + sum(int(t.size) for t in self._turn))
        self._pending = np.zeros(0, dtype=np.int16)
        self._turn = []
        self._in_speech = False

    def create_response(self, instructions: str | None, ref_ns: int, modalities: list[str] | None = None) -> None:
        """Start the echo answer task (the server rejects a second one while one runs); ``modalities``:
        this answer's output modalities (None: the session's)."""
        assert self._cfg is not None
        speak = "audio" in (modalities or self._cfg.modalities)
        if self._texts:
            text = "echo: " + " ".join(self._texts)
            self._texts = []
        else:
            text = "echo: " + (self._last_text or "nothing")
        if self._frames or self._images:
            text += f" ({self._frames} frames, {self._images} images)"
        self._frames = 0
        self._images = 0
        audio = self._last_turn
        if not speak:
            audio = audio[:0]
        elif audio.size == 0:
            t = np.arange(self._cfg.sample_rate // 5) / self._cfg.sample_rate  # 200 ms tone
            audio = (np.sin(2 * np.pi * 440.0 * t) * 8000).astype(np.int16)
        prev = self._task if self._task is not None and not self._task.done() else None
        cfg = self._cfg
        assert cfg is not None
        out = resample(audio, cfg.sample_rate, cfg.output_sample_rate) if audio.size else audio
        words = text.split(" ")
        start = 0
        if prev is None:
            # The first chunk goes out in this call, so the echo backend adds no scheduling
            # delay of its own to end-of-speech -> first audio (the bench measures serving).
            self._emit(ResponseStarted(ref_ns))
            self._emit_chunk(0, words, out, speak)
            start = 1
        else:
            self._count("responses_queued")
        self._task = asyncio.get_running_loop().create_task(self._answer(words, out, ref_ns, prev, start, speak))

    def _emit_chunk(self, i: int, words: list[str], out: np.ndarray, speak: bool) -> None:
        assert self._cfg is not None
        step = self._cfg.output_sample_rate * CHUNK_MS // 1000
        if i < len(words):
            self._emit(AnswerText(words[i] if i == 0 else " " + words[i], 0))
        if speak and i * step < out.size:
            self._emit(AnswerAudio(out[i * step:(i + 1) * step], 0))

    async def _answer(self, words: list[str], out: np.ndarray, ref_ns: int, prev: asyncio.Task[None] | None,
                      start: int, speak: bool) -> None:
        if prev is not None:  # a turn that ended while an answer ran (interrupt_response off) waits its turn
            try:
                await prev
            except asyncio.CancelledError:
                if not prev.cancelled():
                    raise
            self._emit(ResponseStarted(ref_ns))
        cfg = self._cfg
        assert cfg is not None
        step = cfg.output_sample_rate * CHUNK_MS // 1000
        n_chunks = max(len(words), -(-out.size // step) if speak else 0)
        try:
            for i in range(start, n_chunks):
                if i > 0:
                    await self._sleep(self.pace * CHUNK_MS / 1000)
                self._emit_chunk(i, words, out, speak)
            if n_chunks:  # the last chunk plays out before the answer is done
                await self._sleep(self.pace * CHUNK_MS / 1000)
        except Exception as exc:  # a failing answer ends as "failed", never as silence
            self._count("responses_failed")
            if self._sink is not None:
                self._emit(ResponseDone("failed", ref_ns, f"{type(exc).__name__}: {exc}"))
            return
        self._emit(ResponseDone("completed", ref_ns))

    def cancel_response(self, ref_ns: int) -> None:
        """Cancel the running answer task (its ResponseDone('cancelled') follows)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            self._count("responses_cancelled")
            self._emit(ResponseDone("cancelled", ref_ns, "cancelled"))

    def counters(self) -> dict[str, int]:
        """Counters by name."""
        return dict(self._counters)

    async def close(self) -> None:
        """Cancel any answer and wait for it."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._sink = None
