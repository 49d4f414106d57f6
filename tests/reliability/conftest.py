"""Fixtures of the reliability tests: the embedded pipeline's models with a fault-injectable engine."""

from __future__ import annotations

import pytest

from tests.reliability.faults import FaultyEngine


@pytest.fixture(scope="session")
def pipeline_models() -> object:
    """(SharedModels with real VAD/ASR/TTS/vision and `EngineChatBackend(FaultyEngine)`, the engine)."""
    pytest.importorskip("faster_whisper")
    pytest.importorskip("piper")
    from tristream.pipeline.llm import EngineChatBackend
    from tristream.pipeline.models import SharedModels
    from tristream.stages.asr_whisper import WhisperASR
    from tristream.stages.tts import PiperTTS
    from tristream.stages.vad import SileroVAD
    from tristream.stages.vision_cpu import SceneDescriber

    eng = FaultyEngine(tokens_per_answer=3)
    return SharedModels(SileroVAD(threads=1), WhisperASR(threads=1), PiperTTS(deterministic=True),
                        SceneDescriber(threads=1), EngineChatBackend(eng)), eng
