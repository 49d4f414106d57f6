"""The real assistant pipeline behind the real server: 20 clients stream speech + camera at once.

Real VAD (silero), real ASR (Whisper base, CTranslate2), real TTS (piper) and real vision
(OpenCV); the LLM is a scripted chat backend that repeats the transcript, because what is
checked here is the serving path (per-session isolation of audio, video, transcripts and
answer audio), not the language model, which has its own tests.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import numpy as np
import pytest

from tests.serve.helpers import TOKEN, run, url
from tristream.serve.client import stream_media
from tristream.serve.limits import ServerLimits
from tristream.serve.server import RealtimeServer

pytestmark = pytest.mark.slow

SENTENCES = (
    "Please turn on the kitchen lights.",
    "What is the weather like tomorrow?",
    "Call my sister and tell her I am late.",
    "There are seven apples on the table.",
    "My favorite color is green.",
)


class RepeatChat:
    """A deterministic chat backend: "You said: <user text>", plus a marker when a scene was aligned."""

    name = "repeat"

    async def stream(self, messages: list[dict[str, str]], max_tokens: int) -> AsyncIterator[str]:
        # The pipeline prefixes the user message with the aligned scene: "(<scene>)\n<text>".
        lines = messages[-1]["content"].splitlines()
        has_scene = len(lines) > 1 and lines[0].startswith("(") and lines[0].endswith(")")
        seen = " (camera seen)" if has_scene else ""
        user = " ".join(lines[1:] if has_scene else lines)
        words = ("You said: " + user + seen).split(" ")
        for i, w in enumerate(words[:max_tokens]):
            await asyncio.sleep(0)
            yield w if i == 0 else " " + w


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z ]", "", text.lower()).split()


@pytest.fixture(scope="module")
def models() -> object:
    pytest.importorskip("faster_whisper")
    pytest.importorskip("piper")
    from tristream.pipeline.models import SharedModels
    from tristream.stages.asr_whisper import WhisperASR
    from tristream.stages.tts import PiperTTS
    from tristream.stages.vad import SileroVAD
    from tristream.stages.vision_cpu import SceneDescriber

    return SharedModels(SileroVAD(threads=1), WhisperASR(threads=2), PiperTTS(deterministic=True),
                        SceneDescriber(threads=1), RepeatChat())


def _speech(models: object, text: str) -> np.ndarray:
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges

    tts = models.tts  # type: ignore[attr-defined]
    clip = resample(tts.synthesize(text), tts.sample_rate, 24_000)
    a, b = energy_edges(clip, 24_000)
    pcm = np.concatenate([np.zeros(12_000, np.float32), clip[a:b], np.zeros(24_000, np.float32)])
    return (pcm * 32767).astype(np.int16)


def _frames() -> list[tuple[float, bytes]]:
    import cv2

    yy, xx = np.mgrid[0:120, 0:160]
    out = []
    for k in range(12):
        img = np.stack([(xx + 10 * k) % 256, yy % 256, np.full_like(xx, 90)], axis=-1).astype(np.uint8)
        out.append((k * 0.25, cv2.imencode(".jpg", img)[1].tobytes()))
    return out


def test_twenty_clients_real_pipeline_transcripts(models: object) -> None:
    from tristream.serve.pipeline_backend import PipelineBackend

    n = 20
    audio = [_speech(models, s) for s in SENTENCES]
    frames = _frames()

    async def go() -> None:
        from tristream.serve.pipeline_backend import STAGE_TOTALS

        def factory() -> PipelineBackend:
            return PipelineBackend(models)

        factory.collect = STAGE_TOTALS.families  # type: ignore[attr-defined]
        live: list[str] = []

        def scrape(ev: dict) -> None:  # /metrics while sessions are live: per-stage families present
            if ev["type"] == "response.done" and not live:
                live.append(srv.metrics.render())

        srv = RealtimeServer(factory, port=0, tokens=[TOKEN], limits=ServerLimits(max_sessions=n))
        await srv.start()
        try:
            res = await asyncio.gather(*(
                stream_media(url(srv), TOKEN, audio[i % len(SENTENCES)], 24_000, frames=frames, pace=1.0,
                             expect_turns=1, tail_silence_s=0.5, answer_timeout_s=150, on_event=scrape)
                for i in range(n)))
            await asyncio.sleep(0.1)
            closed = srv.metrics.render()
        finally:
            await srv.stop(grace_s=0.0)
        for fam in ("tristream_stage_process_seconds{", "tristream_stage_queue_depth{",
                    "tristream_frame_ring_fill_ratio{"):
            assert fam in live[0], fam
        assert 'tristream_stage_closed_process_seconds{quantile="0.99",stage="asr"}' in closed
        assert live[0].count("# TYPE tristream_stage_queue_depth ") == 1
        for i, r in enumerate(res):
            want = words(SENTENCES[i % len(SENTENCES)])
            assert len(r) == 1, (i, r)
            got = words(r[0].transcript)
            hits = sum(w in got for w in want)
            assert hits >= 0.75 * len(want), (i, want, got)
            assert r[0].status == "completed" and r[0].audio_samples > 0
            assert r[0].answer.startswith("You said:")
            assert r[0].answer.endswith("(camera seen)"), r[0].answer  # frames reached the aligner
    run(go(), timeout=240)


def test_pipeline_record_replay_on_virtual_clock(models: object, tmp_path: object) -> None:
    """A live pipeline session recorded to MCAP replays on the pipeline's virtual clock:
    same transcript and answer text as live, and two replays are identical event for event."""
    from pathlib import Path

    from tristream.observe.record import read_recording
    from tristream.serve.pipeline_backend import PipelineBackend
    from tristream.serve.pipeline_replay import PipelineReplayDriver
    from tristream.serve.replay import compare, replay_events

    rec_dir = Path(str(tmp_path))
    audio = _speech(models, SENTENCES[3])

    async def live() -> None:
        srv = RealtimeServer(lambda: PipelineBackend(models), port=0, tokens=[TOKEN], record_dir=rec_dir)
        await srv.start()
        try:
            res = await stream_media(url(srv), TOKEN, audio, 24_000, frames=_frames(), pace=1.0, expect_turns=1,
                                     tail_silence_s=0.5, answer_timeout_s=60)
            assert res[0].status == "completed"
        finally:
            await srv.stop(grace_s=0.0)
    run(live(), timeout=120)
    events = read_recording(next(rec_dir.glob("*.mcap")))

    async def replay() -> object:
        return await replay_events(events, driver=PipelineReplayDriver(models), audio="ignore")
    r1 = run(replay(), timeout=120)
    r2 = run(replay(), timeout=120)

    def texts(evs: list) -> list[tuple[str, str]]:
        keys = ("transcript", "delta")
        return [(e["type"], e[k]) for e in evs for k in keys
                if k in e and e["type"] != "response.audio.delta"]
    assert texts(r1.replayed) == texts(r1.recorded)  # type: ignore[attr-defined]
    assert compare(r1.replayed, r2.replayed, audio="exact") == []  # type: ignore[attr-defined]
    assert r1.replayed_turns[0].status == "completed"  # type: ignore[attr-defined]
    lat = r1.replayed_turns[0].latencies_ms()  # type: ignore[attr-defined]
    assert lat["eos_to_first_audio_ms"] >= 0
