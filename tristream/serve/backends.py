"""Backend factories by name, shared by `tristream serve`, `tristream replay` and the bench.

- ``assistant`` (the default; ``pipeline`` is the same): the assistant session (VAD -> ASR ->
  LLM -> TTS with barge-in, camera scene) with the embedded real models, through
  `tristream.serve.pipeline_backend`; options ``model=PATH`` (a GGUF file or HF folder instead
  of the embedded SmolLM2), ``device=cpu|cuda|auto``, ``quant=auto|none|int8|int4|fp8`` and
  ``sched=none|ours|...`` (`assistant_plan`: the stages per device), ``asr=whisper`` (streaming
  Whisper, the default on CPU) ``|whisper-utterance|pocketsphinx``, ``vision=tokens|scene`` (on
  CUDA: SigLIP tokens into the LLM context, the default, or the OpenCV scene text).
- ``echo``: `EchoBackend` (no models; a test backend for the protocol and serving-layer load).
- ``engine``: answers on our `LLMEngine`, turn by turn through the scheduler
  (`tristream.serve.sched_backend`). Options ride on the name, so ``tristream serve --backend``
  needs nothing else: ``engine:device=cuda,model=llama-3.2-1b,stages=none,max_tokens=32``
  (defaults: ``device`` cuda when available else cpu, ``model`` smollm2 (the embedded
  SmolLM2; random weights only when a preset such as ``tiny-random`` or ``llama-3.2-1b`` is
  named), ``stages`` none (``embedded``: the CPU speech stages;
  ``gpu``: ASR by our batched streaming Whisper on ``device``, ``asr_model=DIR`` another CT2
  Whisper folder); ``model=smollm2`` is the embedded
  GGUF, a path loads a HF folder or GGUF file). ``sched=ours|fifo|static_priority`` picks the
  scheduler preset, ``sched=none`` the engine's own continuous batching without our scheduler
  (`tristream.serve.unscheduled`, the baseline); ``turn_timeout_ms=T`` sets the silver and
  bronze end-of-turn queue timeout (a shed probe: ``-1`` sheds every such turn).
"""

from __future__ import annotations

from typing import Any

from tristream.serve.backend import BackendFactory
from tristream.serve.echo import EchoBackend

BACKENDS = ("assistant", "pipeline", "engine", "echo")
DEFAULT_BACKEND = "assistant"


class UnknownBackend(Exception):
    """A backend name that is not in `BACKENDS`, or one whose parts are not installed."""


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``name:key=val,key=val`` -> (name, options)."""
    name, _, rest = spec.partition(":")
    opts: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        key, eq, val = part.partition("=")
        if not eq or not key:
            raise UnknownBackend(f"backend option {part!r} in {spec!r} is not key=value")
        opts[key.strip()] = val.strip()
    return name, opts


def engine_options(opts: dict[str, str]) -> dict[str, Any]:
    """Keyword arguments of `sched_backend.engine_factory` from ``engine:`` options (defaults filled)."""
    known = {"device", "model", "stages", "max_tokens", "kv_bytes", "sched", "turn_timeout_ms", "asr_model", "quant",
             "vision"}
    extra = sorted(set(opts) - known)
    if extra:
        raise UnknownBackend(f"unknown engine option {extra[0]!r}; known: {sorted(known)}")
    device = opts.get("device")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    kw: dict[str, Any] = {"device": device, "stages": opts.get("stages", "none"),
                          "model": opts.get("model", "smollm2")}
    for key in ("max_tokens", "kv_bytes"):
        if key in opts:
            kw[key] = int(opts[key])
    kw["sched"] = opts.get("sched", "ours")
    if "quant" in opts:  # the real model's weights (auto: int4 on CPU)
        kw["quant"] = opts["quant"]
    if "vision" in opts:  # stages=gpu: tokens (SigLIP into the LLM context) or scene (OpenCV text)
        kw["vision"] = opts["vision"]
    if "asr_model" in opts:  # stages=gpu: a CTranslate2 Whisper folder instead of the shipped base
        from tristream.serve.speech_stages import AsrSpec

        kw["asr"] = AsrSpec(model_dir=opts["asr_model"])
    if "turn_timeout_ms" in opts:
        kw["turn_timeout_ms"] = float(opts["turn_timeout_ms"])
    return kw


ASSISTANT_OPTIONS = {"model", "device", "quant", "sched", "asr", "vision"}


def assistant_plan(opts: dict[str, str], cuda: bool | None = None) -> tuple[str, dict[str, Any]]:
    """Which factory builds the assistant for ``assistant:`` options, and its arguments.

    The session graph is the same everywhere; its stages follow the device: with CUDA (``device``
    cuda, or auto where CUDA exists) the turns run on our engine under the scheduler with the GPU
    stages (``engine`` factory, ``stages=gpu``: our batched streaming Whisper, incremental prefill
    while the user speaks, and vision tokens of the frames aligned to the speech, ``vision=tokens``;
    ``vision=scene`` keeps the OpenCV scene text); on a CPU the embedded stages with the LLM
    straight on our engine's continuous batching (``sched=none``, the default: on 2 cores with 8
    spoken sessions it answered 23/24 turns at end of speech -> first audio P50 2.4 s, the
    scheduled engine 16/24 at 3.8 s, `bench/serve.py`) or under the scheduler (``sched=ours``,
    ``fifo``, ``static_priority``).
    """
    from tristream.pipeline.prompt import DECODE

    extra = sorted(set(opts) - ASSISTANT_OPTIONS)
    if extra:
        raise UnknownBackend(f"unknown assistant option {extra[0]!r}; known: {sorted(ASSISTANT_OPTIONS)}")
    device = opts.get("device", "auto")
    if device == "auto":
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        device = "cuda" if cuda else "cpu"
    model, quant = opts.get("model") or None, opts.get("quant", "auto")
    if device.startswith("cuda"):
        return "engine", {"device": device, "model": model or "smollm2", "stages": "gpu", "quant": quant,
                          "sched": opts.get("sched", "ours"), "max_tokens": DECODE.max_tokens,
                          "vision": opts.get("vision", "tokens")}
    sched = opts.get("sched", "none")
    if sched != "none":
        return "engine", {"device": device, "model": model or "smollm2", "stages": "embedded", "quant": quant,
                          "sched": sched, "max_tokens": DECODE.max_tokens}
    kw: dict[str, Any] = {"llm_path": model, "device": device, "quant": quant}
    if "asr" in opts:  # whisper (streaming, the default), whisper-utterance, pocketsphinx
        kw["asr"] = opts["asr"]
    return "pipeline", kw


def make_factory(name: str = DEFAULT_BACKEND, pace: float = 0.0) -> BackendFactory:
    """A zero-argument callable creating one backend per session."""
    base, opts = parse_spec(name)
    if base == "echo":
        return lambda: EchoBackend(pace=pace)
    if base in ("assistant", "pipeline"):
        try:
            from tristream.serve.tool_session import tool_pipeline_factory
        except ImportError as exc:
            raise UnknownBackend(f"backend {base!r} is not available: {exc}") from exc
        kind, kw = assistant_plan(opts)
        if kind == "engine":
            from tristream.serve.sched_backend import engine_factory

            return engine_factory(**kw)
        return tool_pipeline_factory(**kw)  # the pipeline with function calling (serve.tool_session)
    if base == "engine":
        from tristream.serve.sched_backend import engine_factory

        return engine_factory(**engine_options(opts))
    import difflib

    near = difflib.get_close_matches(base, BACKENDS, n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise UnknownBackend(f"unknown backend {base!r}; {hint}choose one of {', '.join(BACKENDS)}")
