from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="session")
def models():
    """The embedded models (silero, Whisper base, piper, OpenCV, SmolLM2 on our engine), once."""
    from tristream.pipeline.models import ModelSetupError, load_models
    from tristream.stages.base import ModelUnavailable

    try:
        return load_models(asr="whisper", tts="piper", vision=True)
    except (ModelSetupError, ModelUnavailable) as e:
        pytest.skip(f"embedded models not installed: {e}")


@pytest.fixture(scope="session")
def say(models):
    """Synthesise a 16 kHz clip of `text` with the session's TTS (trimmed to its speech)."""
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges

    cache: dict[str, np.ndarray] = {}

    def _say(text: str) -> np.ndarray:
        if text not in cache:
            tts = models.tts
            pcm = resample(np.asarray(tts.synthesize(text), dtype=np.float32), tts.sample_rate, 16_000)
            a, b = energy_edges(pcm, 16_000)
            cache[text] = pcm[a:b]
        return cache[text]

    return _say
