"""``--backend engine``: sessions whose answers run on our engine, turn by turn through the scheduler.

- `ScheduledChat`: a pipeline `ChatBackend` bound to one session; each ``stream()`` is one turn
  submitted to the process's `ScheduledEngine` at the session's SLA tier. A turn the scheduler
  sheds raises `TurnShed` (an `EngineStepError`, so the pipeline ends the turn cleanly).
- `EngineSessionBackend`: text turns only (``conversation.item.create`` + ``response.create``),
  no speech models: what a GPU box without the embedded CPU stages serves, and what the GPU
  bench drives. Audio and frames are counted and ignored.
- ``stages=embedded``: the full assistant (`PipelineBackend`: VAD, Whisper, piper, OpenCV) with
  its LLM replaced by the session's `ScheduledChat`, so spoken turns go through the scheduler too.
- ``stages=gpu``: as ``embedded``, but the ASR is our streaming Whisper on the engine's device
  (CUDA graphs there), one batched pass for every session with new audio, with partial
  transcripts and word times (`tristream.serve.speech_stages`, `tristream.stages.asr_batched`).

Sheds reach the client as an ``error`` event with code ``scheduler_shed`` (the reason in the
message and in ``response.status_details``) and ``response.done`` with status ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tristream.observe.events import (
    AnswerText,
    EventSink,
    ResponseDone,
    ResponseStarted,
    TurnDelta,
    TurnEnd,
)
from tristream.pipeline.llm import EngineStepError
from tristream.pipeline.prompt import SYSTEM_PROMPT
from tristream.sched.scheduled_engine import ScheduledEngine
from tristream.sched.types import WorkModality
from tristream.serve.backend import BackendConfig, BackendFamily, Family, SessionBackend, TextTurnBackend


class TurnShed(EngineStepError):
    """The scheduler shed this turn (``shed_reason``: queue_full, timeout, answer_aborted, session_refused)."""

    def __init__(self, reason: str, tier: str) -> None:
        super().__init__(f"the scheduler shed this turn ({reason}, tier {tier})")
        self.shed_reason = reason
        self.tier = tier


class ScheduledChat:
    """One session's turns on the shared `ScheduledEngine` (see the module docstring)."""

    name = "engine+sched"

    def __init__(self, se: ScheduledEngine, tier: Callable[[], str], modality: WorkModality = WorkModality.SPEECH,
                 max_tokens: int | None = None, vision: Any = None) -> None:
        """``max_tokens``: a cap on every answer (below the caller's own); ``vision``: the session's
        `tristream.serve.vision_tokens.SessionVision` (its frames' tokens go into the prompts)."""
        self.se = se
        self.max_tokens = max_tokens
        self.vision = vision
        self.prefills = 0
        self._tier = tier
        self.modality = modality
        self.sid: int | None = None
        self._open_tier = ""

    def _session(self) -> int:
        tier = self._tier()
        if self.sid is None or tier != self._open_tier:  # a new tier applies from the next turn
            if self.sid is not None:
                self.se.close(self.sid)
            self.sid = self.se.open(tier)
            self._open_tier = tier
        return self.sid

    def prefill(self, key: str, messages: list[dict[str, str]] | None) -> None:
        """The user is still speaking (`ChatBackend.prefill`): the prompt the turn would get now, with
        the vision tokens of the frames aligned to the speech so far, goes into the session's context
        as scheduled incremental prefill. None (the turn ends or the session closes): nothing to do,
        the answer's turn continues the context (`TurnExecutor.begin`)."""
        if messages is None:
            return
        images: list[Any] = []
        if self.vision is not None:
            self.vision.refresh()
            images = self.vision.ready()
        keys, spans = self.se.encode_with_images(messages, images)
        self.se.prefill(self._session(), self.se.stable_prefix(keys), spans)
        self.prefills += 1

    async def stream(self, messages: list[dict[str, str]], max_tokens: int) -> AsyncIterator[str]:
        """Text deltas of this turn's answer; closing the iterator cancels the answer."""
        sid = self._session()
        n = max_tokens if self.max_tokens is None else min(max_tokens, self.max_tokens)
        images = await self.vision.for_turn() if self.vision is not None else []
        keys, spans = self.se.encode_with_images(messages, images)
        h = self.se.submit(sid, keys, n, self.modality, spans)
        ended = False
        try:
            while True:
                ev = await h.events.get()
                if type(ev) is TurnDelta:
                    yield ev.text
                    continue
                assert type(ev) is TurnEnd
                ended = True
                if ev.kind == "shed":
                    raise TurnShed(ev.detail, self._open_tier)
                if ev.kind == "error":
                    raise EngineStepError(ev.detail)
                return
        finally:
            if not ended:
                self.se.cancel(sid)

    def close(self) -> None:
        """The session ended: its scheduler state goes."""
        if self.sid is not None:
            self.se.close(self.sid)
            self.sid = None


class EngineSessionBackend(TextTurnBackend):
    """Text turns of one session on the scheduled engine; see the module docstring."""

    def __init__(self, se: ScheduledEngine, max_tokens: int = 32, max_history_turns: int = 6) -> None:
        super().__init__()
        self.se = se
        self.max_tokens = max_tokens
        self.max_history = 2 * max_history_turns
        self.cfg: BackendConfig | None = None
        self.chat: ScheduledChat | None = None
        self.system = ""
        self.history: list[dict[str, str]] = []
        self.pending: list[str] = []

    async def start(self, config: BackendConfig, sink: EventSink) -> None:
        """Bind the session to the scheduler (opened at its first turn, at the tier then in force)."""
        self.cfg, self.sink = config, sink
        self.chat = ScheduledChat(self.se, lambda: self.cfg.tier if self.cfg else "silver", WorkModality.TEXT)

    def update(self, config: BackendConfig) -> None:
        """Instructions and tier apply from the next turn."""
        self.cfg = config

    def push_text(self, role: str, text: str, images: list[bytes], ref_ns: int) -> None:
        """User text waits for ``response.create``; system text replaces the instructions."""
        if role == "system":
            self.system = text
            return
        if images:
            self._count("ignored_images", len(images))
        if text:
            self.pending.append(text)

    def commit_audio(self, ref_ns: int) -> None:
        """No audio turns: a commit answers pending text, if any."""
        if self.pending:
            self.create_response(None, ref_ns)
        else:
            self._count("manual_commit_ignored")

    def create_response(self, instructions: str | None, ref_ns: int, modalities: list[str] | None = None) -> None:
        """Answer the pending text (or the last user message again) as one scheduled turn."""
        user = " ".join(self.pending) or next((m["content"] for m in reversed(self.history)
                                                if m["role"] == "user"), "Hello.")
        self.pending = []
        system = instructions or (self.cfg.instructions if self.cfg else "") or self.system or SYSTEM_PROMPT
        messages = [{"role": "system", "content": system}, *self.history[-self.max_history:],
                    {"role": "user", "content": user}]
        self.history.append({"role": "user", "content": user})
        self._emit(ResponseStarted(time.monotonic_ns()))
        self._task = asyncio.get_running_loop().create_task(self._answer(messages))

    async def _answer(self, messages: list[dict[str, str]]) -> None:
        assert self.chat is not None
        parts: list[str] = []
        status, reason, stats = "completed", "", {}
        try:
            async with contextlib.aclosing(self.chat.stream(messages, self.max_tokens)) as deltas:  # type: ignore[type-var]
                async for d in deltas:
                    parts.append(d)
                    self._emit(AnswerText(d, time.monotonic_ns()))
        except TurnShed as exc:
            self._count(f"shed_{exc.shed_reason}")
            status, reason, stats = "failed", str(exc), {"shed": exc.shed_reason, "tier": exc.tier}
        except EngineStepError as exc:
            self._count("engine_errors")
            status, reason = "failed", str(exc)
        self.history.append({"role": "assistant", "content": "".join(parts)})
        self._task = None
        self._emit(ResponseDone(status, time.monotonic_ns(), reason, stats))

    async def close(self) -> None:
        """Cancel an answer in flight (the scheduler drops its work, the engine frees its blocks at
        the next step) and leave the scheduler."""
        await super().close()
        await asyncio.sleep(0)
        if self.chat is not None:
            self.chat.close()


def engine_factory(model: str = "tiny-random", device: str = "cpu", stages: str = "none",
                   kv_bytes: int | None = None, max_tokens: int = 32, scheduler: Any = None,
                   sched: str = "ours", turn_timeout_ms: float | None = None, asr: Any = None,
                   tts: Any = None, vad: Any = None, quant: str = "auto", vision: str = "auto") -> BackendFamily:
    """Load the engine once (``model``: a preset name with random weights, ``tiny-random``, ``smollm2``
    for the embedded GGUF, or a HF folder / GGUF path) and return the per-session factory.

    ``stages``: ``none`` (text turns), ``embedded`` (the CPU speech/vision stages around it) or
    ``gpu`` (the same, but ASR is our batched streaming Whisper on ``device``, shared by every
    session: `tristream.serve.speech_stages`; ``asr``/``tts``/``vad`` override its models, for tests;
    ``vision``: ``tokens`` (the default of ``gpu`` on CUDA, ``auto``): camera frames aligned to the
    speech become vision tokens in the LLM context (`tristream.serve.vision_tokens`; SigLIP-B/16 with
    random weights: none exist offline), ``scene``: the OpenCV scene text, as on a CPU).
    ``scheduler``: a `SchedulerConfig`; else ``sched`` names a preset (``none``: no scheduler, the
    engine's own batching, for comparison); ``turn_timeout_ms`` overrides the silver / bronze
    end-of-turn timeouts.
    """
    from tristream.sched.real import build_engine

    if kv_bytes is None:
        kv_bytes = (8 << 30) if device.startswith("cuda") else (64 << 20)
    if sched == "none":
        if stages != "none":
            raise ValueError("sched=none (no scheduler) serves text turns only: use stages=none")
        from tristream.serve.unscheduled import engine_factory as unscheduled

        return unscheduled(model=model, device=device, kv_bytes=kv_bytes, max_tokens=max_tokens)
    if scheduler is None:
        scheduler = scaled_config(1.0 if device.startswith("cuda") else CPU_TARGET_FACTOR, sched)
    if turn_timeout_ms is not None:
        import dataclasses

        from tristream.sched.types import Kind, Tier

        queue = {t: (q if t is Tier.GOLD else dataclasses.replace(
            q, timeouts_ms={**q.timeouts_ms, Kind.TURN_END: turn_timeout_ms})) for t, q in scheduler.queue.items()}
        scheduler = dataclasses.replace(scheduler, queue=queue)
    speech: Any = None
    if stages == "gpu":  # before the engine: its thread must not run while the Whisper graphs are captured
        from tristream.serve.speech_stages import streaming_models

        speech = streaming_models(device, asr=asr, tts=tts, vad=vad)
    from tristream.pipeline.prompt import DECODE

    se = ScheduledEngine(build_engine(model, device, kv_bytes, quant), scheduler, temperature=DECODE.temperature,
                         repetition_penalty=DECODE.repetition_penalty)
    make: Callable[[], SessionBackend]
    vt: Any = None
    cpu_asr: Any = None
    if stages == "none":
        def make() -> SessionBackend:
            return EngineSessionBackend(se, max_tokens)
    elif stages == "embedded":
        from tristream.pipeline.models import load_models
        from tristream.serve.pipeline_backend import PipelineBackend

        models = load_models(with_llm=False)  # the LLM is the scheduled engine, per session
        cpu_asr = models.asr

        def make() -> SessionBackend:
            return PipelineBackend(models, chat_for_session=lambda tier: ScheduledChat(se, tier, max_tokens=max_tokens))
    elif stages == "gpu":
        from tristream.serve.pipeline_backend import PipelineBackend

        if vision == "auto":
            vision = "tokens" if device.startswith("cuda") else "scene"
        if vision not in ("tokens", "scene"):
            raise ValueError(f"vision must be 'tokens', 'scene' or 'auto', got {vision!r}")
        if vision == "tokens":
            import dataclasses

            from tristream.serve.vision_tokens import VisionPipelineBackend, build_vision_tokens

            vt = build_vision_tokens(se.engine, device)
            models = dataclasses.replace(speech, vision=None)  # the tokens replace the scene text

            def make() -> SessionBackend:
                sv = vt.session()
                return VisionPipelineBackend(models, sv, chat_for_session=lambda tier: ScheduledChat(
                    se, tier, max_tokens=max_tokens, vision=sv))
        else:
            def make() -> SessionBackend:
                return PipelineBackend(speech, chat_for_session=lambda tier: ScheduledChat(
                    se, tier, max_tokens=max_tokens))
    else:
        raise ValueError(f"stages must be 'none', 'embedded' or 'gpu', got {stages!r}")

    from tristream.serve.pipeline_metrics import STAGE_TOTALS, pipeline_families
    from tristream.serve.speech_stages import asr_families

    def collect() -> list[Family]:
        fams = sched_families(se)
        if cpu_asr is not None:  # the closed sessions' stage totals and the CPU recogniser, as the assistant's
            fams += pipeline_families(cpu_asr)
        elif stages != "none":  # the pipeline's per-stage totals (closed sessions) too
            fams += STAGE_TOTALS.families()
        if speech is not None:
            fams += asr_families(speech.asr)
        if vt is not None:
            fams += vt.families()
        return fams

    return BackendFamily(make, collect=collect, healthy=lambda: se.error is None, engine=se, scheduler=se.sched,
                         asr=speech.asr if speech is not None else None)


CPU_TARGET_FACTOR = 20.0
"""On a CPU the tiers' P99 targets, queue timeouts and the controllers' step-budget range are
this many times the GPU ones (gold 1 s, silver 3 s, bronze 10 s): the defaults are set for an H200."""


def scaled_config(factor: float, preset: str = "ours") -> Any:
    """A scheduler preset with every promise scaled by ``factor``: each tier's response target and
    queue timeouts, the controllers' step budgets and the answer pace (a decode token counts as
    late, which feeds the degradation ladder, only ``factor`` times later than on the GPU)."""
    import dataclasses

    from tristream.sched.config import PRESETS
    from tristream.sched.types import TierSpec

    if preset not in PRESETS:
        raise ValueError(f"unknown scheduler {preset!r}; choose one of {sorted(PRESETS)} or 'none'")
    base = PRESETS[preset]()
    tiers = {t: TierSpec(t, spec.p99_target_ms * factor) for t, spec in base.tiers.items()}
    queue = {t: dataclasses.replace(q, timeouts_ms={k: v * factor for k, v in q.timeouts_ms.items()})
             for t, q in base.queue.items()}
    a = base.aimd  # the step budgets the controllers move between scale with the targets
    aimd = dataclasses.replace(a, min_limit_ms=a.min_limit_ms * factor, max_limit_ms=a.max_limit_ms * factor,
                               increase_ms=a.increase_ms * factor)
    shape = dataclasses.replace(base.shape, decode_pace_ms=base.shape.decode_pace_ms * factor)
    return dataclasses.replace(base, tiers=tiers, queue=queue, aimd=aimd, shape=shape)


def sched_families(se: ScheduledEngine) -> list[Family]:
    """The scheduler's shed ledger and the engine loop's counters as Prometheus families."""
    st = se.stats()
    shed = [("tristream_sched_shed_total", dict(zip(("reason", "tier", "kind"), k.split("/"), strict=True)),
             float(v)) for k, v in st["shed"].items()]
    counters = [("tristream_sched_counter", {"name": k}, float(v)) for k, v in sorted(st["counters"].items())]
    return [("tristream_sched_shed_total", "counter", "work shed by the scheduler (reason, tier, kind)", shed),
            ("tristream_sched_counter", "gauge", "scheduled engine loop counters", counters),
            ("tristream_sched_steps_total", "counter", "engine steps run by the scheduler",
             [("tristream_sched_steps_total", {}, float(st["steps"]))])]
