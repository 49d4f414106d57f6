"""`PipelineBackend`: the assistant pipeline (`tristream.pipeline.session.Session`) behind the server.

The pipeline session has no event callbacks, so the adapter observes it at its seams
without changing it: a proxy around the session's VAD stream (speech start/end), one around
its ASR stream (transcripts), one around its chat backend (answer text deltas), the audio
sink (answer audio, converted to int16 at the client's output rate) and the turn hooks
(`begin_turn`, `finish_turn`, `barge_in`) of a `Session` subclass.

Time: when the client sends capture timestamps (``capture_ts_us`` on audio and video),
both streams are mapped onto the server's reference clock by one `SourceClock` per session
(they come from one client clock), so the aligner joins frames to speech by capture time;
without them, arrival time is used.

Differences from the protocol's full surface (counted, documented in docs/protocol.md):
turns always end by the pipeline's VAD (``input_audio_buffer.commit`` only answers pending
text); ``create_response: false`` is not honoured for audio turns.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any, cast

import numpy as np

from tristream.serve.audio import resample_int16
from tristream.serve.backend import (
    AudioDelta,
    BackendConfig,
    BackendFactory,
    EventSink,
    ResponseDone,
    ResponseStarted,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    TranscriptDelta,
    TranscriptDone,
    VideoFrame,
)
from tristream.serve.media import MediaError

_text_turn_ids = itertools.count(1_000_000)


class _Tap:
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


class _TappedChat:
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


class _Sink:
    """The session's audio sink: answer audio becomes `AudioDelta` events."""

    def __init__(self, backend: PipelineBackend) -> None:
        self.b = backend

    def write(self, pcm: np.ndarray, sample_rate: int) -> None:
        self.b._on_audio(pcm, sample_rate)

    def interrupt(self) -> None:
        self.b._count("sink_interrupts")


class PipelineBackend:
    """One server session driven by one pipeline `Session` over process-wide `SharedModels`."""

    def __init__(self, models: Any, clock: Any | None = None) -> None:
        self.models = models
        self._session_clock = clock
        self._cfg: BackendConfig | None = None
        self._sink: EventSink | None = None
        self._session: Any = None
        self._clock: Any = None
        self._counters: dict[str, int] = {}
        self._pending_texts: list[str] = []
        self._samples_in = 0
        self._active = False

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _emit(self, ev: Any) -> None:
        if self._sink is not None:
            self._sink(ev)

    def _now(self) -> int:
        return int(self._session.clock.now_ns())

    async def start(self, config: BackendConfig, sink: EventSink) -> None:
        """Build the pipeline session and hook its seams."""
        from tristream.core.clock import SourceClock
        from tristream.pipeline.session import Session, SessionConfig

        backend = self

        class _HookedSession(Session):  # type: ignore[misc]
            def begin_turn(self, turn: Any) -> Any:
                rec = super().begin_turn(turn)
                backend._active = True
                backend._emit(ResponseStarted(backend._now()))
                return rec

            def finish_turn(self, turn_id: int, heard: str) -> None:
                was = self.current is not None and self.current.turn_id == turn_id
                super().finish_turn(turn_id, heard)
                if was and backend._active:
                    backend._active = False
                    backend._emit(ResponseDone("completed", backend._now()))

            def barge_in(self, t_ns: int) -> None:
                super().barge_in(t_ns)
                if backend._active:
                    backend._active = False
                    backend._emit(ResponseDone("cancelled", backend._now(), "barge_in"))

        self._cfg = config
        self._sink = sink
        scfg = SessionConfig(system_prompt=config.instructions or SessionConfig().system_prompt,
                             hangover_ms=float(config.silence_duration_ms))
        s = _HookedSession(self.models, sink=_Sink(self), clock=self._session_clock, config=scfg)
        s.vad = cast(Any, _Tap(s.vad, self._on_vad))
        s.asr = cast(Any, _Tap(s.asr, self._on_asr))
        s.llm = cast(Any, _TappedChat(s.llm, self._on_text, self._on_llm_error))
        self._session = s
        self._clock = SourceClock("client")
        s.start()

    def update(self, config: BackendConfig) -> None:
        """Instructions apply to the next turn; VAD hangover is fixed at session start."""
        self._cfg = config
        if self._session is not None and config.instructions:  # empty = keep the pipeline's default
            self._session.conversation.system = config.instructions
        self._count("session_updates")

    # ---- seams
    def _on_vad(self, evs: list[Any]) -> None:
        for ev in evs:
            ms = int(ev.sample_index * 1000 // 16_000)
            if str(ev.kind) == "start":
                self._emit(SpeechStarted(ms, self._now()))
            else:
                self._emit(SpeechStopped(ms, self._now()))

    def _on_asr(self, evs: list[Any]) -> None:
        for tr in evs:
            if tr.final:
                self._emit(TranscriptDelta(tr.text, self._now()))
                self._emit(TranscriptDone(tr.text, self._now()))
            else:
                self._emit(TranscriptDelta(tr.text, self._now()))

    def _on_llm_error(self, exc: Exception) -> None:
        self._count("llm_failures")
        if self._active:
            self._active = False
            self._emit(ResponseDone("failed", self._now(), f"{type(exc).__name__}: {exc}"))

    def _on_text(self, delta: str) -> None:
        if self._active:
            self._emit(TextDelta(delta, self._now()))

    def _on_audio(self, pcm: np.ndarray, rate: int) -> None:
        if not self._active or self._cfg is None:
            self._count("audio_after_response_dropped")
            return
        i16 = np.clip(np.rint(np.asarray(pcm, np.float32) * 32767), -32768, 32767).astype(np.int16)
        self._emit(AudioDelta(resample_int16(i16, rate, self._cfg.output_sample_rate), self._now()))

    # ---- inputs
    def push_audio(self, pcm: np.ndarray, ref_ns: int, capture_ts_us: int | None) -> None:
        """16 kHz int16 chunk; capture time mapped to the reference clock when given."""
        dur_ns = pcm.size * 1_000_000_000 // 16_000
        if capture_ts_us is not None:
            start = capture_ts_us * 1000
            ref = self._clock.observe_span(start, start + dur_ns, ref_ns)
        else:
            ref = ref_ns - dur_ns
        self._samples_in += pcm.size
        if not self._session.push_audio(pcm.astype(np.float32) / 32768.0, ref):
            self._count("audio_chunks_dropped_input_full")

    def push_frame(self, frame: VideoFrame) -> None:
        """Decode to RGB and file it in the session's frame ring at its capture time."""
        import cv2

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
        ref = self._clock.observe(frame.capture_ts_us * 1000, frame.ref_ns)
        if not self._session.push_frame(img, ref):
            self._count("frames_dropped_input_full")

    def push_text(self, role: str, text: str, images: list[bytes], ref_ns: int) -> None:
        """User text waits for ``response.create``; system text replaces the instructions."""
        if role == "system":
            self._session.conversation.system = text
            return
        if images:
            self._count("images_ignored", len(images))
        self._pending_texts.append(text)

    def commit_audio(self, ref_ns: int) -> None:
        """Turns end by the pipeline's VAD; a manual commit answers pending text, if any."""
        if self._pending_texts:
            self.create_response(None, ref_ns)
        else:
            self._count("manual_commit_ignored")

    def clear_audio(self, ref_ns: int) -> None:
        """The pipeline's VAD owns its buffer; counted, nothing else."""
        self._count("clear_ignored")

    def create_response(self, instructions: str | None, ref_ns: int) -> None:
        """Answer the pending text (or the last user turn again)."""
        from tristream.pipeline.turns import UserTurn

        text = " ".join(self._pending_texts)
        self._pending_texts = []
        if not text:
            last = self._session.records[-1].user_text if self._session.records else ""
            text = last or "Hello."
        now = self._now()
        turn = UserTurn(next(_text_turn_ids), text, now, now, now)
        if not self._session.llm_stage.inbox.put_data(turn):
            self._count("responses_dropped_llm_full")

    def cancel_response(self, ref_ns: int) -> None:
        """Stop LLM, TTS and playout now (the pipeline's barge-in path)."""
        self._session.barge_in(self._now())

    def counters(self) -> dict[str, int]:
        """Adapter counters plus the pipeline's drop counters."""
        out = dict(self._counters)
        if self._session is not None:
            for k, v in self._session.drops.snapshot().items():
                out[f"session_{k}"] = v
        return out

    def gauges(self) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
        """Per-stage latency, queue depth and drops, and the frame ring's watermark (Prometheus families)."""
        s = self._session
        if s is None:
            return []
        sid = s.id
        lat: list[tuple[str, dict[str, str], float]] = []
        depth: list[tuple[str, dict[str, str], float]] = []
        drops: list[tuple[str, dict[str, str], float]] = []
        for st in s.stats()["stages"]:
            name = st["name"]
            pm = st["process_ms"]
            for q, key in (("0.5", "p50"), ("0.95", "p95"), ("0.99", "p99")):
                lat.append(("tristream_stage_process_seconds", {"session": sid, "stage": name, "quantile": q},
                            pm.get(key, 0.0) / 1e3))
            lat.append(("tristream_stage_process_seconds_count", {"session": sid, "stage": name}, pm.get("count", 0.0)))
            depth.append(("tristream_stage_queue_depth", {"session": sid, "stage": name}, float(st["queued"])))
            depth.append(("tristream_stage_queue_high_water", {"session": sid, "stage": name}, float(st["high_water"])))
            for reason, n in st["drops"].items():
                drops.append(("tristream_stage_drops_total", {"session": sid, "stage": name, "reason": reason},
                              float(n)))
        for reason, n in s.drops.snapshot().items():
            drops.append(("tristream_stage_drops_total", {"session": sid, "stage": "session", "reason": reason},
                          float(n)))
        ring = [("tristream_frame_ring_fill_ratio", {"session": sid}, float(s.frames.fill_ratio)),
                ("tristream_frame_ring_high_water", {"session": sid}, float(s.frames.high_water))]
        return [
            ("tristream_stage_process_seconds", "summary", "per-stage processing time per packet", lat),
            ("tristream_stage_queue_depth", "gauge", "packets waiting in each stage inbox (and high water)", depth),
            ("tristream_stage_drops_total", "counter", "packets dropped by stage and reason", drops),
            ("tristream_frame_ring_fill_ratio", "gauge", "camera frame ring fill (and high water)", ring),
        ]

    async def close(self) -> None:
        """Close the pipeline session (stops its stage tasks); its stage timings join the process totals."""
        self._sink = None
        if self._session is not None:
            await self._session.close()
            await asyncio.sleep(0)
            STAGE_TOTALS.add_session(self._session)


class StageTotals:
    """Per-stage processing-time histograms and drops summed over every closed session of the process."""

    def __init__(self) -> None:
        from tristream.core.metrics import DropCounter, LatencyHistogram

        self._hist_cls = LatencyHistogram
        self.timing: dict[str, Any] = {}
        self.drops = DropCounter("stages")
        self.sessions = 0

    def add_session(self, session: Any) -> None:
        """Merge one finished session's stage timings and drops."""
        self.sessions += 1
        for st in session.stages:
            h = self.timing.get(st.name)
            if h is None:
                h = self.timing[st.name] = self._hist_cls()
            try:
                h.merge(st.timing)
            except (ValueError, AttributeError):
                continue
            for reason, n in st.inbox.drops.snapshot().items():
                self.drops.add(f"{st.name}:{reason}", n)
        for reason, n in session.drops.snapshot().items():
            self.drops.add(f"session:{reason}", n)

    def families(self) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
        """Prometheus families (no session label)."""
        lat: list[tuple[str, dict[str, str], float]] = []
        for name, h in sorted(self.timing.items()):
            for q in (50.0, 95.0, 99.0):
                lat.append(("tristream_stage_closed_process_seconds", {"stage": name, "quantile": f"{q / 100:g}"},
                            h.percentile(q) / 1e9))
            lat.append(("tristream_stage_closed_process_seconds_count", {"stage": name}, float(h.count)))
        drops = [("tristream_stage_closed_drops_total", {"stage": k.split(":", 1)[0], "reason": k.split(":", 1)[1]},
                  float(v)) for k, v in self.drops.snapshot().items()]
        return [("tristream_stage_closed_process_seconds", "summary",
                 "per-stage processing time per packet over closed sessions", lat),
                ("tristream_stage_closed_drops_total", "counter", "drops by stage and reason over closed sessions",
                 drops)]


STAGE_TOTALS = StageTotals()


def pipeline_factory(**load_kw: Any) -> BackendFactory:
    """Load the shared models once (seconds) and return a factory of per-session backends.

    The factory's ``collect`` attribute exports the process-wide stage totals to ``/metrics``.
    """
    from tristream.pipeline.models import load_models

    models = load_models(**load_kw)

    def factory() -> PipelineBackend:
        return PipelineBackend(models)

    factory.collect = STAGE_TOTALS.families  # type: ignore[attr-defined]
    factory.healthy = lambda: bool(getattr(models.llm, "healthy", True))  # type: ignore[attr-defined]
    return factory
