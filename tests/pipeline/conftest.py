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
    """Synthesise a 16 kHz clip of `text` (trimmed to its speech) with a deterministic voice.

    Not the session voice's `synthesize`: piper samples VITS noise on every call (livelier answers),
    so the same text is a different clip in every run, and Whisper base hears 5-8% of the
    renditions of "What is the capital of France?" as "... capital of friends?" (whatever the
    CPU load: the pipeline's text is a function of the clip alone). Test input must be the
    same every run: piper's `synthesize_exact` (no noise, as the demo's input), or espeak-ng,
    which is deterministic by itself.
    """
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges

    tts = models.tts
    synth = getattr(tts, "synthesize_exact", tts.synthesize)
    cache: dict[str, np.ndarray] = {}

    def _say(text: str) -> np.ndarray:
        if text not in cache:
            pcm = resample(np.asarray(synth(text), dtype=np.float32), tts.sample_rate, 16_000)
            a, b = energy_edges(pcm, 16_000)
            cache[text] = pcm[a:b]
        return cache[text]

    return _say
