"""The real assistant pipeline behind the real server: 20 clients stream speech + camera at once.

Real VAD (silero), real ASR (Whisper base, CTranslate2), real TTS (piper) and real vision
(OpenCV); the LLM is a scripted chat backend (`pipeline_helpers.RepeatChat`): what is checked
here is the serving path (per-session isolation of audio, video, transcripts and answer
audio), not the language model, which has its own tests.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.serve.helpers import TOKEN, run, url
from tests.serve.pipeline_helpers import ALWAYS_SCENE, SENTENCES, frames, speech, words
from tristream.serve.client import stream_media
from tristream.serve.limits import ServerLimits
from tristream.serve.server import RealtimeServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(pipeline_models: object) -> object:
    return pipeline_models


def _speech(models: object, text: str) -> np.ndarray:
    return speech(models, text, lead_s=0.5, tail_s=1.0)


def _frames() -> list[tuple[float, bytes]]:
    return frames()


def test_twenty_clients_real_pipeline_transcripts(models: object) -> None:
    from tristream.serve.backend import BackendFamily
    from tristream.serve.pipeline_backend import PipelineBackend

    n = 20
    audio = [_speech(models, s) for s in SENTENCES]
    frames = _frames()

    async def go() -> None:
        from tristream.serve.pipeline_backend import STAGE_TOTALS

        factory = BackendFamily(lambda: PipelineBackend(models, session_config=ALWAYS_SCENE),
                                collect=STAGE_TOTALS.families)
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
