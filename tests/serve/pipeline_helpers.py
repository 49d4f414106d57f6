"""Shared parts of the tests that run the real pipeline behind the server.

The LLM is `RepeatChat`, a scripted chat backend that repeats the transcript, because what
these tests check is the serving path (isolation, turn control, scene routing), not the
language model, which has its own tests. VAD, ASR, TTS and vision are the real models.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

SENTENCES = (
    "Please turn on the kitchen lights.",
    "What is the weather like tomorrow?",
    "Call my sister and tell her I am late.",
    "There are seven apples on the table.",
    "My favorite color is green.",
)


def _always_scene() -> object:
    from tristream.pipeline.session import SessionConfig

    return SessionConfig(scene_when="always", max_sentences=0)


ALWAYS_SCENE = _always_scene()
"""Sessions for the scripted chat: the prompt carries the scene on every turn (the alignment
tests check it arrives) and answers are not cut after their first sentence."""


class RepeatChat:
    """A deterministic chat backend: "You said: <user text>", plus a marker when a scene was aligned."""

    name = "repeat"

    async def stream(self, messages: list[dict[str, str]], max_tokens: int) -> AsyncIterator[str]:
        # The prompt prefixes the user message with the aligned scene: "(The camera sees: <scene>)\n<text>".
        lines = messages[-1]["content"].splitlines()
        has_scene = len(lines) > 1 and lines[0].startswith("(") and lines[0].endswith(")")
        seen = " (camera seen)" if has_scene else ""
        user = " ".join(lines[1:] if has_scene else lines)
        words = ("You said: " + user + seen).split(" ")
        for i, w in enumerate(words[:max_tokens]):
            await asyncio.sleep(0)
            yield w if i == 0 else " " + w


def words(text: str) -> list[str]:
    """Lower-case words without punctuation."""
    return re.sub(r"[^a-z ]", "", text.lower()).split()


def recall(want_text: str, got_text: str) -> float:
    """Share of the wanted words found in the transcript."""
    want, got = words(want_text), words(got_text)
    return sum(w in got for w in want) / max(1, len(want))


def load_models() -> Any:
    """Real silero VAD, Whisper base, piper (deterministic) and OpenCV vision; `RepeatChat` as LLM."""
    from tristream.pipeline.models import SharedModels
    from tristream.stages.asr_whisper import WhisperASR
    from tristream.stages.tts import PiperTTS
    from tristream.stages.vad import SileroVAD
    from tristream.stages.vision_cpu import SceneDescriber

    return SharedModels(SileroVAD(threads=1), WhisperASR(threads=2), PiperTTS(deterministic=True),
                        SceneDescriber(threads=1), RepeatChat())


def speech(models: Any, text: str, lead_s: float = 0.5, tail_s: float = 1.0) -> np.ndarray:
    """``text`` spoken by the TTS as 24 kHz int16, with silence around it."""
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges

    tts = models.tts
    clip = resample(tts.synthesize(text), tts.sample_rate, 24_000)
    a, b = energy_edges(clip, 24_000)
    pcm = np.concatenate([np.zeros(int(lead_s * 24_000), np.float32), clip[a:b],
                          np.zeros(int(tail_s * 24_000), np.float32)])
    return (pcm * 32767).astype(np.int16)


def frames() -> list[tuple[float, bytes]]:
    """Twelve 160x120 JPEG camera frames, 0.25 s apart."""
    import cv2

    yy, xx = np.mgrid[0:120, 0:160]
    out = []
    for k in range(12):
        img = np.stack([(xx + 10 * k) % 256, yy % 256, np.full_like(xx, 90)], axis=-1).astype(np.uint8)
        out.append((k * 0.25, cv2.imencode(".jpg", img)[1].tobytes()))
    return out
