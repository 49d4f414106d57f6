"""`PipelineBackend`: the assistant pipeline (`tristream.pipeline.session.Session`) behind the server.

The adapter observes the session through its observer API (`Session.subscribe`: speech
edges, transcripts, answer start, text and end, all `tristream.observe.events` types, passed
to the server as they are) and is the session's audio sink (answer audio, converted to int16
at the client's output rate); a per-session chat backend goes in through `Session(llm=...)`.

Time: when the client sends capture timestamps (``capture_ts_us`` on audio and video),
each stream is mapped onto the server's reference clock by its own `SourceClock` (microphone and
camera: a clock counts gaps and reorderings on one timeline), so the aligner joins frames to
speech by capture time, and each clock's duplicates, gaps, wraps and resets reach `/metrics`
(`serve.metrics.clock_families`); without them, arrival time is used.

Turn control (`pipeline_turns`): with ``turn_detection: null`` audio is buffered and
``input_audio_buffer.commit`` ends the turn (``input_audio_buffer.clear`` drops it); with
``create_response: false`` (and in manual mode) a finished turn waits for ``response.create``;
``input_image`` parts join the camera frame ring, so the next answer's scene includes them.
Still not honoured (counted): ``input_audio_buffer.clear`` while the pipeline's VAD owns the
audio (server VAD mode).

Per-packet work on the event loop (one loop thread serves every session): with ``coalesce_audio``
(the GPU server) the microphone's 20 ms appends are coalesced, and the VAD windows they complete
are inferred off the loop, for all sessions at once: `_VADWorker` (one per loop) hands the chunks
that every session's client sent since its last job to one thread (`vad_pool`), which runs them
through `SileroVAD.precompute` (one batched ONNX call per round of windows; ONNX Runtime lets go of
the GIL meanwhile), and, once done, pushes each session's chunks down its stages, in order; the
session's VAD stage then finds its windows' results ready and runs no model on the loop. One job
is in flight at a time, so the chunks that come meanwhile make the next job (at light load each
chunk goes alone, delayed by its own job, about 0.1 ms a window). A gap in capture time splits a
session's chunks into pushes of their own within a job. Frames do not wait for audio (the frame
ring is ordered by capture time, not arrival); every other input (text, commit, clear, response
calls, close) first waits for the session's audio in flight and pushes what is pending, so their
order with the audio is kept. With ``decode_frames_off_loop`` (the GPU server too) camera JPEGs
are decoded in a shared pool of threads (OpenCV lets go of the GIL) and filed in arrival order when
decoded; a corrupt one is counted and refused with `MediaError` at the session's next frame (one
frame late).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from tristream.observe.events import (
    SPEECH_RATE,
    AnswerAudio,
    EncodedFrame,
    EventSink,
    ResponseDone,
    ResponseStarted,
    TranscriptDelta,
    TranscriptDone,
)
from tristream.serve.answers import AnswerLog
from tristream.serve.backend import BackendConfig, BackendFamily
from tristream.serve.media import MediaError
from tristream.serve.pipeline_metrics import STAGE_TOTALS, Family, StageTotals, stage_gauges
from tristream.serve.pipeline_turns import ManualAudioBuffer, TurnGate, decode_image, transcribe_utterance
from tristream.stages.base import Resampler

__all__ = ["STAGE_TOTALS", "PipelineBackend", "StageTotals", "pipeline_factory"]

_text_turn_ids = itertools.count(1_000_000)

_decode_pool: concurrent.futures.ThreadPoolExecutor | None = None
_decode_pool_lock = threading.Lock()


def decode_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's JPEG decoder threads (``TRISTREAM_DECODE_THREADS``, default 4)."""
    global _decode_pool
    with _decode_pool_lock:
        if _decode_pool is None:
            n = int(os.environ.get("TRISTREAM_DECODE_THREADS", "4"))
            _decode_pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, n), thread_name_prefix="jpeg-decode")
        return _decode_pool


def _decode_jpeg(data: bytes) -> np.ndarray | None:
    import cv2

    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    return None if bgr is None else np.ascontiguousarray(bgr[:, :, ::-1])


_vad_pool: concurrent.futures.ThreadPoolExecutor | None = None


def vad_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's VAD thread (one: jobs of a loop run one at a time, in order)."""
    global _vad_pool
    with _decode_pool_lock:
        if _vad_pool is None:
            _vad_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vad-batch")
        return _vad_pool


Segment = tuple[np.ndarray, int, int]
"""Coalesced microphone audio: float32 samples, its reference start, and the chunks it holds."""


@dataclass(slots=True, eq=False)
class _Chunk:
    """One session's audio in a `_VADJob`: its pushes (split at gaps in capture time), in order."""

    backend: PipelineBackend
    segments: list[Segment]
    job: _VADJob | None = None
    pushed: bool = False


@dataclass(slots=True, eq=False)
class _VADJob:
    worker: _VADWorker
    chunks: list[_Chunk] = field(default_factory=list)
    planned: list[tuple[Any, int, Any, np.ndarray]] = field(default_factory=list)
    """Per VAD to run: the stream, its plan's generation, the plan, the samples."""
    future: concurrent.futures.Future[Any] | None = None
    applied: bool = False

    def run(self) -> tuple[list[Any], int]:
        """`SileroVAD.precompute` of the planned streams, one call per model (any thread): the results
        in the order of ``planned``, and the ONNX calls made."""
        out: list[Any] = [None] * len(self.planned)
        groups: dict[int, tuple[Any, list[int]]] = {}
        for i, (vad, _, _, _) in enumerate(self.planned):
            groups.setdefault(id(vad.model), (vad.model, []))[1].append(i)
        calls = 0
        for model, idx in groups.values():
            res, c = model.precompute([(self.planned[i][2], self.planned[i][3]) for i in idx])
            calls += c
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        return out, calls


class _VADWorker:
    """One per event loop: the sessions' coalesced audio, its VAD windows inferred in `vad_pool`
    before it is pushed (see the module docstring). Sessions whose VAD has no plan (its lookahead
    failed, and audio of it is still queued in its stages) go with the job unplanned: their VAD
    stage runs its own windows."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: list[PipelineBackend] = []
        self.handle: asyncio.Handle | None = None
        self.job: _VADJob | None = None  # in flight
        self.jobs = 0
        self.calls = 0
        self.chunks = 0
        self.unplanned = 0

    def add(self, backend: PipelineBackend) -> None:
        self.pending.append(backend)
        if self.handle is None and self.job is None:
            self.handle = self.loop.call_soon(self.submit)

    def submit(self) -> None:
        """Take every pending session's audio into one job (none while one is in flight)."""
        self.handle = None
        if self.job is not None:
            return
        backs, self.pending = self.pending, []
        job = _VADJob(self)
        for b in backs:
            b._in_vad_batch = False
            segs = b._take_pending()
            if not segs:
                continue
            c = _Chunk(b, segs, job)
            b._in_flight.append(c)
            job.chunks.append(c)
            vad = getattr(b._session, "vad", None)
            if vad is None or not hasattr(vad, "plan"):
                continue
            plan, gen = vad.plan(len(b._in_flight) == 1 and b._stages_drained())
            if plan is None:
                self.unplanned += 1
                continue
            job.planned.append((vad, gen, plan, segs[0][0] if len(segs) == 1 else
                                np.concatenate([f for f, _, _ in segs])))
        if not job.chunks:
            return
        self.jobs += 1
        self.chunks += len(job.chunks)
        self.job = job
        if job.planned:
            job.future = vad_pool().submit(job.run)
        else:
            job.future = concurrent.futures.Future()
            job.future.set_result(([], 0))
        loop = self.loop
        job.future.add_done_callback(lambda _f: loop.call_soon_threadsafe(self._finish, job))

    def apply(self, job: _VADJob) -> None:
        """Hand the job's windows to the sessions' VADs and push its audio (once; the loop thread)."""
        if job.applied:
            return
        job.applied = True
        assert job.future is not None
        try:
            results, calls = job.future.result()
            self.calls += calls
        except Exception:  # each session computes its own windows then
            import logging

            logging.getLogger(__name__).exception("batched VAD failed; sessions run their own")
            results = []
        for (vad, gen, _, _), (windows, plan) in zip(job.planned, results, strict=False):
            vad.take_precomputed(gen, windows, plan)
        for c in job.chunks:
            try:
                c.backend._push_chunk(c)
            except Exception:  # one session's failure leaves the others' audio going
                import logging

                logging.getLogger(__name__).exception("pushing a session's audio failed")

    def _finish(self, job: _VADJob) -> None:
        self.apply(job)
        if self.job is job:
            self.job = None
        if self.pending and self.handle is None:
            self.submit()


_vad_workers: dict[int, _VADWorker] = {}


def _vad_worker(loop: asyncio.AbstractEventLoop) -> _VADWorker:
    w = _vad_workers.get(id(loop))
    if w is None or w.loop is not loop:
        w = _vad_workers[id(loop)] = _VADWorker(loop)
    return w


class PipelineBackend:
    """One server session driven by one pipeline `Session` over process-wide `SharedModels`."""

    decode_frames_off_loop = False
    """JPEG frames decoded in `decode_pool` (refusal one frame late) rather than on the event loop."""
    coalesce_audio = False
    """Microphone appends coalesced, their VAD windows inferred off the loop for all sessions at
    once (`_VADWorker`; the GPU server; on the CPU pipeline the 20-client test's transcripts missed
    words in 2 of 5 runs with coalescing, 0 of 4 without, so it stays off there)."""

    def __init__(self, models: Any, clock: Any | None = None, chat_for_session: Any = None,
                 session_config: Any = None) -> None:
        """``chat_for_session(tier_getter)``: a per-session chat backend replacing ``models.llm``
        (``--backend engine --stages embedded``: the session's turns on the scheduled engine);
        ``session_config``: the `SessionConfig` the client's settings start from."""
        self.models = models
        self._base_config = session_config
        self._chat_for_session = chat_for_session
        self._own_chat: Any = None
        self._session_clock = clock
        self._cfg: BackendConfig | None = None
        self._sink: EventSink | None = None
        self._session: Any = None
        self._clock: Any = None
        self._frame_clock: Any = None
        self._counters: dict[str, int] = {}
        self.answers = AnswerLog()
        """What each answer said as played (`truncate_answer`)."""
        self._pending_texts: list[str] = []
        self._samples_in = 0
        self._active = False
        self._manual = ManualAudioBuffer()
        self._gate: TurnGate | None = None
        self._transcribing: asyncio.Task[None] | None = None
        self._answer_when_transcribed = False
        self._last_frame_ns = -1
        self._tasks: set[asyncio.Task[Any]] = set()
        self._out_rate: Resampler | None = None  # answer audio -> the client's output rate
        self._audio_pending: list[tuple[np.ndarray, int, int]] = []  # (f32, ref start, ref end) not yet pushed
        self._in_vad_batch = False  # registered with the loop's `_VADWorker` for its next job
        self._in_flight: deque[_Chunk] = deque()  # audio in a VAD job, not yet pushed
        self._frames_decoding: deque[tuple[concurrent.futures.Future[Any], int, int]] = deque()
        self._frame_error: str | None = None

    @property
    def session(self) -> Any:
        """The pipeline `Session` behind this connection (None before `start`)."""
        return self._session

    @property
    def busy(self) -> bool:
        """Work of this adapter still running outside the pipeline's stages (a manual transcription)."""
        return self._transcribing is not None

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _emit(self, ev: Any) -> None:
        if self._sink is not None:
            self._sink(ev)

    def _now(self) -> int:
        return int(self._session.clock.now_ns())

    async def start(self, config: BackendConfig, sink: EventSink) -> None:
        """Build the pipeline session and observe it (`Session.subscribe`); answer audio comes
        through this object's `write` (the session's `AudioSink`)."""
        import dataclasses

        from tristream.core.clock import SourceClock
        from tristream.pipeline.session import Session, SessionConfig

        self._cfg = config
        self._sink = sink
        base = self._base_config or SessionConfig()
        scfg = dataclasses.replace(base, system_prompt=config.instructions or base.system_prompt,
                                   hangover_ms=float(config.silence_duration_ms), speak="audio" in config.modalities)
        if self._chat_for_session is not None:
            self._own_chat = self._chat_for_session(lambda: self._cfg.tier if self._cfg else "silver")
        s = Session(self.models, sink=self, clock=self._session_clock, config=scfg, llm=self._own_chat)
        s.subscribe(self._on_event)
        self._gate = TurnGate(s.llm_stage.inbox, self._hold_turns, self._count)
        s.asr_stage.downstream = [cast(Any, self._gate)]
        self._session = s
        # one clock per stream (a clock counts gaps on one timeline); capture_ts_us is a
        # non-wrapping µs clock of the client
        self._clock = SourceClock.for_unit("client:mic", "us")
        self._frame_clock = SourceClock.for_unit("client:cam", "us")
        s.set_turn_detection(float(config.silence_duration_ms), config.eagerness, config.vad_threshold)
        s.start()

    def _hold_turns(self) -> bool:
        return self._cfg is not None and not self._cfg.create_response

    def update(self, config: BackendConfig) -> None:
        """Instructions apply to the next turn; the VAD threshold from the next window; silence and
        semantic turn detection to the next end of speech (the VAD's own hangover is the one it started with; longer silences are
        waited for by the turn taker, `Session.set_turn_detection`)."""
        self._cfg = config
        if self._session is not None:
            self._session.config.speak = "audio" in config.modalities  # text-only turns do no TTS
            self._session.set_turn_detection(float(config.silence_duration_ms), config.eagerness,
                                             config.vad_threshold)
        if self._session is not None and config.instructions:  # empty = keep the pipeline's default
            self._session.conversation.system = config.instructions
        self._count("session_updates")

    # ---- the session's audio sink
    def write(self, pcm: np.ndarray, rate: int) -> None:
        """One played chunk of answer audio: int16 at the client's output rate, as `AnswerAudio`."""
        self.answers.played(self._session, rate)
        if self._session is None or not self._session.assistant_active or self._cfg is None:
            self._count("audio_after_response_dropped")
            return
        i16 = np.clip(np.rint(np.asarray(pcm, np.float32) * 32767), -32768, 32767).astype(np.int16)
        out = self._out_rate
        if out is None or out.rate_in != rate or out.rate_out != self._cfg.output_sample_rate:
            out = self._out_rate = Resampler(rate, self._cfg.output_sample_rate)
        chunk = out.push(i16)
        if chunk.size:
            self._emit(AnswerAudio(chunk, self._now()))

    @property
    def last_answer(self) -> int | None:
        """Key of the answer whose `ResponseDone` went out last (`truncate_answer`)."""
        return self.answers.last

    def truncate_answer(self, key: int, audio_end_ms: int) -> str:
        """The user heard only the first `audio_end_ms` of answer `key` (``conversation.item.truncate``):
        its assistant message in the history becomes the words of that audio; returns them."""
        heard = self.answers.truncate(self._session, key, audio_end_ms)
        if heard is None:
            return ""
        self._count("answers_truncated")
        return heard

    def interrupt(self) -> None:
        """Barge-in: the resampler's tail is dropped (nothing else is buffered here); counted."""
        self._out_rate = None
        self._count("sink_interrupts")

    def _on_event(self, ev: Any) -> None:
        """A session event: to the server; an answer's end first sends the rest of its audio."""
        if type(ev) is ResponseDone:
            self.answers.done(self._session)
        if type(ev) is ResponseDone and self._out_rate is not None:
            tail = self._out_rate.flush()
            if tail.size and ev.status == "completed":
                self._emit(AnswerAudio(tail, self._now()))
        self._emit(ev)

    # ---- inputs
    def push_audio(self, pcm: np.ndarray, ref_ns: int, capture_ts_us: int | None) -> None:
        """16 kHz int16 chunk; capture time mapped to the reference clock when given."""
        dur_ns = pcm.size * 1_000_000_000 // SPEECH_RATE
        if capture_ts_us is not None:
            start = capture_ts_us * 1000
            ref = self._clock.observe_span(start, start + dur_ns, ref_ns)
        else:
            ref = ref_ns - dur_ns
        self._samples_in += pcm.size
        f32 = pcm.astype(np.float32) / 32768.0
        if self._cfg is not None and not self._cfg.vad:  # manual mode: the commit ends the turn
            self._flush_audio()
            if not self._manual.add(f32, ref):
                self._count("manual_audio_dropped_full")
            return
        if not self.coalesce_audio:
            if not self._session.push_audio(f32, ref):
                self._count("audio_chunks_dropped_input_full")
            return
        self._audio_pending.append((f32, ref, ref + dur_ns))
        if not self._in_vad_batch:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): at once
                self._flush_audio()
                return
            self._in_vad_batch = True
            _vad_worker(loop).add(self)

    def _take_pending(self) -> list[Segment]:
        """The chunks not yet pushed, coalesced into segments (a new one at each gap or overlap in
        capture time of more than 2 ms)."""
        pend = self._audio_pending
        if not pend or self._session is None:
            return []
        self._audio_pending = []
        segs: list[Segment] = []
        i = 0
        for j in range(1, len(pend) + 1):
            if j == len(pend) or abs(pend[j][1] - pend[j - 1][2]) > 2_000_000:
                part = pend[i:j]
                f32 = part[0][0] if len(part) == 1 else np.concatenate([c for c, _, _ in part])
                segs.append((f32, part[0][1], len(part)))
                i = j
        return segs

    def _stages_drained(self) -> bool:
        """Whether the session's input stage has handled every audio chunk pushed to it."""
        inp = getattr(self._session, "input", None)
        return inp is None or (not inp.inbox.data and not inp.busy)

    def _push_segments(self, segs: list[Segment]) -> None:
        for f32, ref, n in segs:
            if n > 1:
                self._count("audio_chunks_coalesced", n - 1)
            if not self._session.push_audio(f32, ref):
                self._count("audio_chunks_dropped_input_full", n)

    def _push_chunk(self, c: _Chunk) -> None:
        """Push a VAD job's chunk of this session (in order: the oldest in flight is it)."""
        if c.pushed:
            return
        c.pushed = True
        if self._in_flight and self._in_flight[0] is c:
            self._in_flight.popleft()
        elif c in self._in_flight:
            self._in_flight.remove(c)
        if self._session is not None:
            self._push_segments(c.segments)

    def _flush_audio(self) -> None:
        """Push this session's audio now: the VAD job it is in waited for, then what is pending
        (its windows run by the session's own VAD stage); see the module docstring."""
        while self._in_flight:
            c = self._in_flight[0]
            job = c.job
            assert job is not None and job.future is not None
            concurrent.futures.wait([job.future])
            job.worker.apply(job)
            if self._in_flight and self._in_flight[0] is c:  # its push failed in the job: not again
                self._in_flight.popleft()
        segs = self._take_pending()
        if segs:
            self._push_segments(segs)

    def push_frame(self, frame: EncodedFrame) -> None:
        """Decode to RGB and file it in the session's frame ring at its capture time."""
        import cv2

        if self._frame_error is not None:
            err, self._frame_error = self._frame_error, None
            raise MediaError(err)
        if frame.format == "jpeg" and self.decode_frames_off_loop:
            ref = self._frame_clock.observe(frame.capture_ts_us * 1000, frame.ref_ns)
            fut = decode_pool().submit(_decode_jpeg, frame.data)
            self._frames_decoding.append((fut, ref, len(frame.data)))
            loop = asyncio.get_running_loop()
            fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(self._file_decoded))
            return
        if self._frames_decoding:  # a raw frame after JPEGs still decoding: those first
            concurrent.futures.wait([f for f, _, _ in self._frames_decoding])
            self._file_decoded()
        if frame.format == "jpeg":
            bgr = cv2.imdecode(np.frombuffer(frame.data, np.uint8), cv2.IMREAD_COLOR)
            if bgr is None:
                self._count("frames_dropped_undecodable")
                raise MediaError(f"the JPEG frame ({len(frame.data)} bytes) is corrupt; frame dropped")
            img = np.ascontiguousarray(bgr[:, :, ::-1])
        elif frame.format == "rgb24":
            img = np.frombuffer(frame.data, np.uint8).reshape(frame.height or 0, frame.width or 0, 3)
        else:
            img = np.frombuffer(frame.data, np.uint8).reshape(frame.height or 0, frame.width or 0)
        ref = self._frame_clock.observe(frame.capture_ts_us * 1000, frame.ref_ns)
        self._file_frame(img, ref)

    def _file_decoded(self) -> None:
        """File the frames decoded so far, in arrival order (the ring is time-ordered)."""
        q = self._frames_decoding
        while q and q[0][0].done():
            fut, ref, size = q.popleft()
            if self._session is None:
                continue
            img = None if fut.exception() is not None else fut.result()
            if img is None:
                self._count("frames_dropped_undecodable")
                self._frame_error = f"a JPEG frame ({size} bytes) was corrupt; it was dropped"
                continue
            self._file_frame(img, ref)

    def _file_frame(self, img: np.ndarray, ref: int) -> None:
        self._last_frame_ns = max(self._last_frame_ns, ref)
        if not self._session.push_frame(img, ref):
            self._count("frames_dropped_input_full")

    def push_text(self, role: str, text: str, images: list[bytes], ref_ns: int) -> None:
        """User text waits for ``response.create``; images join the camera frame ring (the scene
        of the next answer); system text replaces the instructions."""
        self._flush_audio()
        if role == "system":
            self._session.conversation.system = text
            return
        decoded = [decode_image(im) for im in images]  # all or nothing: a bad image refuses the item
        for img in decoded:
            # filed at arrival, after any camera frame already filed (the ring is time-ordered)
            ref = max(self._now(), self._last_frame_ns + 1)
            self._file_frame(img, ref)
            self._count("images_to_scene")
        if text:
            self._pending_texts.append(text)

    def commit_audio(self, ref_ns: int) -> None:
        """Manual mode: the buffered audio becomes the user's turn (transcribed, scene described,
        held for ``response.create``). With server VAD the pipeline's VAD owns the turns: a
        commit answers pending text, if any."""
        self._flush_audio()
        if self._cfg is not None and not self._cfg.vad:
            pcm, start, end = self._manual.take()
            if pcm.size == 0:
                self._count("manual_commit_empty")
                return
            scene = self._session.describe_scene(start, end)  # in parallel with the ASR, as at a VAD end
            prev = self._transcribing
            self._transcribing = asyncio.get_running_loop().create_task(
                self._manual_turn(prev, pcm, start, end, scene))
            return
        if self._pending_texts:
            self.create_response(None, ref_ns)
        else:
            self._count("manual_commit_ignored")

    async def _manual_turn(self, prev: asyncio.Task[None] | None, pcm: np.ndarray, start: int, end: int,
                           scene: Any) -> None:
        from tristream.pipeline.turns import UserTurn

        me = self._transcribing
        try:
            if prev is not None:  # commits are answered in order
                await asyncio.shield(prev)
            s = self._session
            loop = asyncio.get_running_loop()
            text = await loop.run_in_executor(s.pool, transcribe_utterance, s.models.asr, s.id, pcm, start, end)
            self._emit(TranscriptDelta(text, self._now()))
            self._emit(TranscriptDone(text, self._now()))
            if not text:
                self._count("manual_turn_empty_transcript")
            else:
                assert self._gate is not None
                self._gate.keep(UserTurn(next(_text_turn_ids), text, start, end, self._now(), scene))
        except Exception as exc:  # the ASR failed: the turn is lost, the session is not
            self._count("manual_turn_failed")
            self._emit(TranscriptDone("", self._now()))
            if self._answer_when_transcribed:
                self._answer_when_transcribed = False
                self._emit(ResponseStarted(self._now()))
                self._emit(ResponseDone("failed", self._now(), f"{type(exc).__name__}: {exc}"))
            return
        finally:
            if self._transcribing is me:
                self._transcribing = None
        if self._answer_when_transcribed and self._transcribing is None:
            self._answer_when_transcribed = False
            self.create_response(None, self._now())

    def clear_audio(self, ref_ns: int) -> None:
        """Manual mode: drop the buffered turn. Server VAD mode: the pipeline's VAD owns its
        buffer; counted, nothing else."""
        self._flush_audio()
        if self._cfg is not None and not self._cfg.vad:
            self._manual.clear()
            self._count("manual_buffer_cleared")
        else:
            self._count("clear_ignored")

    def create_response(self, instructions: str | None, ref_ns: int, modalities: list[str] | None = None) -> None:
        """Answer the held turn and pending text (or, with neither, the last user turn again);
        ``modalities`` without ``audio``: this answer is text only (no TTS)."""

        self._flush_audio()
        if self._transcribing is not None:  # a committed turn is still in the ASR: answer it when done
            self._answer_when_transcribed = True
            return
        assert self._gate is not None
        held = self._gate.release()
        text = " ".join(self._pending_texts)
        self._pending_texts = []
        now = self._now()
        if held is not None:
            turn = held
            if text:
                turn.text = f"{turn.text} {text}"
        else:
            if not text:
                last = self._session.records[-1].user_text if self._session.records else ""
                text = last or "Hello."
            speak = None if modalities is None else "audio" in modalities
            if not self._session.ask(text, speak, self._scene_now(now)):
                self._count("responses_dropped_llm_full")
            return
        if modalities is not None:
            turn.speak = "audio" in modalities
        if not self._session.llm_stage.inbox.put_data(turn):
            self._count("responses_dropped_llm_full")

    def _scene_now(self, now: int) -> Any:
        """The scene for a text turn: the latest frame (camera or ``input_image``) once the input
        stage has filed everything queued; None without any frame."""
        if self._last_frame_ns < 0:
            return None
        s = self._session

        async def scene() -> Any:
            await s.settle_input()
            fut = s.describe_scene(None, max(now, self._last_frame_ns))
            return None if fut is None else await fut

        task = asyncio.get_running_loop().create_task(scene())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel_response(self, ref_ns: int) -> None:
        """Stop LLM, TTS and playout now (the pipeline's barge-in path)."""
        self._flush_audio()
        self._session.barge_in(self._now())

    def counters(self) -> dict[str, int]:
        """Adapter counters plus the pipeline's drop counters."""
        out = dict(self._counters)
        if self._session is not None:
            for k, v in self._session.drops.snapshot().items():
                out[f"session_{k}"] = v
        return out

    def gauges(self) -> list[Family]:
        """Per-stage latency, queue depth and drops, and the frame ring's watermark (Prometheus families)."""
        if self._session is None:
            return []
        from tristream.serve.metrics import clock_families

        clocks = {k: c for k, c in (("mic", self._clock), ("cam", self._frame_clock)) if c is not None}
        return stage_gauges(self._session) + clock_families(clocks, session=self._session.id)

    async def close(self) -> None:
        """Close the pipeline session (stops its stage tasks); its stage timings join the process totals."""
        self._flush_audio()
        self._frames_decoding.clear()  # frames still decoding are not filed
        self._sink = None
        if self._transcribing is not None:
            self._transcribing.cancel()
        if self._session is not None:
            await self._session.close()
            if self._own_chat is not None:
                self._own_chat.close()
            await asyncio.sleep(0)
            for c in (self._clock, self._frame_clock):
                if c is not None:
                    c.close()  # holes still open become gaps
            STAGE_TOTALS.add_session(self._session)


def pipeline_factory(**load_kw: Any) -> BackendFamily:
    """Load the shared models once (seconds) and return a factory of per-session backends.

    Its ``collect`` exports the process-wide stage totals to ``/metrics``.
    """
    from tristream.pipeline.models import load_models

    models = load_models(**load_kw)
    return BackendFamily(lambda: PipelineBackend(models), collect=STAGE_TOTALS.families,
                         healthy=lambda: bool(getattr(models.llm, "healthy", True)))
