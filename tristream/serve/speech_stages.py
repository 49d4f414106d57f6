"""The speech stages of ``--backend engine:stages=gpu``: which model runs where.

| stage | model | device |
|---|---|---|
| VAD | silero (ONNX Runtime) | CPU, per session (sub-ms per 32 ms window) |
| ASR | our Whisper base (`tristream.speech`, the shipped CTranslate2 weights loaded into our module) behind `BatchedWhisperASR`: one batcher thread, one `WhisperRunner` pass for every session with new audio | the engine's ``device``: CUDA graphs on a GPU, the same code eagerly on a CPU |
| LLM | the scheduled engine (`ScheduledChat` per session) | ``device`` |
| TTS | piper (ONNX Runtime) | CPU |
| vision | CUDA: tokens of the aligned frames (`serve.vision_tokens`; random SigLIP weights); else OpenCV | ``device`` |
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tristream.serve.metrics import Family


@dataclass(slots=True, frozen=True)
class AsrSpec:
    """How to build the streaming ASR: a CTranslate2 Whisper folder (None: the shipped base)."""

    model_dir: str | None = None
    use_graphs: bool | None = None


def streaming_models(device: str, asr: Any = None, tts: Any = None, vad: Any = None, threads: int = 1) -> Any:
    """`SharedModels` for ``stages=gpu``: silero VAD, `BatchedWhisperASR` on ``device``, piper, OpenCV.

    ``asr``: a ready `BatchedWhisperASR`, an `AsrSpec`, or None (Whisper base from the wheels);
    ``tts``: a synthesizer model (default: piper, else espeak-ng); ``vad``: a `SileroVAD` (default: the
    ONNX file of the installed ``silero-vad`` wheel). The LLM slot holds a placeholder:
    every session's chat is its `ScheduledChat`. The ASR is warmed up (graphs captured) here.
    """
    from tristream.pipeline.llm import OpenAIChatBackend
    from tristream.pipeline.models import SharedModels
    from tristream.stages.asr_batched import BatchedWhisperASR
    from tristream.stages.tts import default_tts
    from tristream.stages.vad import SileroVAD
    from tristream.stages.vision_cpu import SceneDescriber

    if asr is None or isinstance(asr, AsrSpec):
        spec = asr or AsrSpec()
        asr = BatchedWhisperASR.load(device, spec.model_dir, use_graphs=spec.use_graphs)
        asr.warm_up()
    tts_model = tts if tts is not None else default_tts()
    tts_model.synthesize("Hello there.")  # first-call costs before the first turn
    from tristream.stages.base import ModelUnavailable

    try:
        vision: Any = SceneDescriber(threads=threads)
    except ModelUnavailable as exc:  # e.g. OpenCV 5 (no Haar cascades): answers go without a scene
        logging.getLogger("tristream.serve").warning("no scene descriptions: %s", exc)
        vision = None
    return SharedModels(vad if vad is not None else SileroVAD(threads=threads), asr, tts_model, vision,
                        OpenAIChatBackend("unused://"))


def asr_families(asr: Any) -> list[Family]:
    """The shared streaming ASR's counters as Prometheus families (passes, batch, graphs, errors)."""
    st, rs = asr.stats, asr.runner.stats
    counters = {"passes": st.passes, "stream_updates": st.stream_updates, "catch_up_passes": st.catch_up_passes,
                "utterances": st.utterances, "finals": st.finals, "aborted": st.aborted, "errors": st.errors,
                "loop_words_dropped": st.loop_words_dropped, "graphs_captured": rs.captured,
                "eager_passes": rs.eager_passes, "decode_steps": rs.decode_steps}
    return [("tristream_asr_counter", "gauge", "shared streaming Whisper counters",
             [("tristream_asr_counter", {"name": k}, float(v)) for k, v in counters.items()]),
            ("tristream_asr_max_batch", "gauge", "most sessions served by one Whisper pass",
             [("tristream_asr_max_batch", {}, float(st.max_batch))]),
            ("tristream_asr_pass_seconds_total", "counter", "time in Whisper passes",
             [("tristream_asr_pass_seconds_total", {}, float(st.pass_s))])]


def asr_stream_families(asr: Any) -> list[Family]:
    """The shared CPU streaming recogniser's counters (`StreamStats`: updates, commits, finals,
    speculation hits, tail re-decodes, decode seconds) as one Prometheus family; none for a
    recogniser without them."""
    from dataclasses import asdict, is_dataclass

    stats = getattr(asr, "stats", None)
    if stats is None or not is_dataclass(stats) or isinstance(stats, type):
        return []
    rows = [("tristream_asr_counter", {"name": k}, float(v)) for k, v in asdict(stats).items()
            if isinstance(v, (int, float))]
    return [("tristream_asr_counter", "gauge", "shared streaming Whisper counters", rows)]
