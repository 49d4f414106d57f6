from __future__ import annotations

import numpy as np
import pytest

from tristream.stages.base import ModelUnavailable
from tristream.stages.synth import SENTENCES, SpeechTrack, make_track


@pytest.fixture(scope="session")
def tts():
    """Piper with the bundled voice (deterministic), else espeak-ng; skip if neither is installed."""
    from tristream.stages.tts import EspeakTTS, PiperTTS

    try:
        return PiperTTS(deterministic=True)
    except ModelUnavailable:
        try:
            return EspeakTTS()
        except ModelUnavailable as e:
            pytest.skip(f"no TTS to synthesise test speech: {e}")


@pytest.fixture(scope="session")
def track(tts) -> SpeechTrack:
    """Three known sentences separated by 0.8–1.2 s of near-silence, 16 kHz."""
    return make_track(tts.synthesize, tts.sample_rate, SENTENCES[:3])


def words(text: str) -> set[str]:
    """Lower-case words without punctuation."""
    return {w for w in "".join(c if c.isalnum() or c == " " else " " for c in text.lower()).split()}


def word_recall(ref: str, hyp: str) -> float:
    """Fraction of the reference's words present in the hypothesis."""
    r = words(ref)
    return len(r & words(hyp)) / max(len(r), 1)


def chunks(pcm: np.ndarray, n: int):
    for i in range(0, pcm.shape[0], n):
        yield i, pcm[i:i + n]
