"""Models shared by every session of a process: loaded once, on first use."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from tristream.engine.cli_support import ModelSetupError
from tristream.pipeline.llm import ChatBackend, EngineChatBackend, OpenAIChatBackend


@dataclass(slots=True)
class SharedModels:
    """VAD, ASR, TTS, vision and LLM for every session of this process."""

    vad: Any
    asr: Any
    tts: Any
    vision: Any | None
    llm: ChatBackend | None
    """None when every session brings its own (`Session(llm=...)`)."""
    turn: Any | None = None
    """The end-of-turn model (`stages.turn_model.SmartTurn`), None where its file is not installed."""


_CACHE: dict[tuple[Any, ...], SharedModels] = {}
_LOCK = threading.Lock()


def load_models(asr: str = "whisper", tts: str = "piper", vision: bool = True,
                llm_url: str | None = None, llm_path: str | None = None, llm_model: str = "default",
                threads: int = 1, device: str = "auto", quant: str = "auto", with_llm: bool = True) -> SharedModels:
    """Load (once per process and argument set) the models sessions share.

    ASR: ``whisper`` (streaming Whisper base, `asr_stream`), ``whisper-utterance`` (one decode
    of each utterance at its end), ``pocketsphinx``. The LLM: `llm_url` (an OpenAI-compatible endpoint), or our engine for `llm_path` (None: the
    embedded SmolLM2) on `device` with `quant` weights (`tristream.engine.cli_support.load_engine`);
    ``with_llm=False``: no shared LLM (each session brings its own chat backend).
    ``threads``: Whisper's CTranslate2 threads. One, because its greedy decoder steps are too
    small to split: on 2 cores a 6 s buffer decodes in 184 ms on one thread against 233 ms on
    two (`WhisperASR.encode` + `generate`), and the second core stays with the LLM and TTS.
    """
    key = (asr, tts, vision, llm_url, llm_path, llm_model, threads, device, quant, with_llm)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        from tristream.stages.vad import SileroVAD

        vad = SileroVAD(threads=1)
        if asr in ("whisper", "whisper-utterance"):
            from tristream.stages.asr_whisper import WhisperASR

            asr_model: Any = WhisperASR(threads=threads)
            if asr == "whisper":  # streaming: committed words while the user speaks (`asr_stream`)
                from tristream.stages.asr_stream import AgreementWhisper

                asr_model = AgreementWhisper(asr_model)
        elif asr == "pocketsphinx":
            from tristream.stages.asr_pocketsphinx import PocketsphinxASR

            asr_model = PocketsphinxASR()
        else:
            raise ModelSetupError(f"unknown ASR {asr!r}; expected 'whisper', 'whisper-utterance' or 'pocketsphinx'")
        from tristream.stages.tts import default_tts

        tts_model = default_tts(prefer=tts)
        vision_model = None
        if vision:
            from tristream.stages.vision_cpu import SceneDescriber

            vision_model = SceneDescriber(threads=1)
        llm: ChatBackend | None
        if not with_llm:
            llm = None
        elif llm_url:
            llm = OpenAIChatBackend(llm_url, model=llm_model)
        else:
            llm = EngineChatBackend.load(llm_path, device, quant)
        models = SharedModels(vad, asr_model, tts_model, vision_model, llm, _turn_model())
        _warm_up(models)
        _CACHE[key] = models
        return models


def _turn_model() -> Any | None:
    """Smart Turn when the pipecat-ai wheel's model file is installed; else the silence rule alone."""
    from tristream.stages.base import ModelUnavailable
    from tristream.stages.turn_model import SmartTurn

    try:
        return SmartTurn()
    except (ModelUnavailable, ImportError) as e:
        import logging

        logging.getLogger("tristream.pipeline").info("no end-of-turn model (%s): silence decides", e)
        return None


def _warm_up(models: SharedModels) -> None:
    """Run each model once so that the first user turn does not pay first-call costs."""
    import numpy as np

    models.tts.synthesize("Hello there.")
    transcribe = getattr(models.asr, "transcribe", None)
    if transcribe is not None:
        transcribe(np.zeros(16_000, dtype=np.float32))
    if models.vision is not None:
        models.vision.stream("warm-up").describe(np.zeros((240, 320, 3), dtype=np.uint8), 0)


__all__ = ["ModelSetupError", "SharedModels", "load_models"]
