"""Drive the real engine with the scheduler's plans (`bench/sched.py --real`): `RealEngineBackend`.

Mapping of a plan onto `tristream.engine.LLMEngine`: each session's current turn is one
engine context (`add_request(generate=False)` with a shared system prefix, so prefix caching
serves it); a planned PREFILL / TURN_END chunk is appended as that many token ids just before
the step; a TURN_END that completes calls `start_generation(max_tokens=answer)` so the chunk's
logits give the first token in this very step. The step runs through the engine's public
`step(allow=planned sequences, max_batch=planned decodes, max_prefill_tokens=planned tokens)`:
sequences the plan leaves out keep their KV blocks but do not run, which is how a
step-boundary preemption of a decode is enforced. Planned ASR units and images run through the
graphed Whisper / SigLIP runners (`EncoderLoad`, random weights) in the same step,
ASR first (its pass ends with the one device→host copy of its tokens), then the frames
(asynchronous graph replays) while the host prepares the LLM step.

Every step's composition and measured time is kept (`samples`) so the step-time model can
be refitted to the device, and a per-phase breakdown (`phases`: scheduler, backend, ASR,
vision, engine host work, decode, prefill, sampling, sync; host and GPU ms, see `phases.py`)
says where the time goes (`bench/sched.py --real`, through `bench/sched_real.py`, writes both to its
JSON).
"""


from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.phases import PhaseTimer
from tristream.sched.backend import StepResult
from tristream.sched.batcher import BatchPlan
from tristream.sched.types import Kind

IMAGE_BUCKETS = (1, 2, 4, 8, 16, 32)
ASR_BUCKETS = (1, 2, 4, 8, 16)


class EncoderLoad:
    """Graphed SigLIP-B/16 and Whisper-tiny runners fed with fixed random inputs."""

    def __init__(self, device: str, asr_window_s: float = 10.0, asr_tokens: int = 8,
                 tiny: bool = False) -> None:
        """tiny: small random configs (CPU smoke tests)."""
        import torch

        from tristream.speech.audio_store import AudioStore
        from tristream.speech.config import WhisperDims, WhisperTokens
        from tristream.speech.config import preset as whisper_preset
        from tristream.speech.runner import WhisperRunner
        from tristream.speech.whisper import Whisper
        from tristream.vision.graphs import VisionGraphBank
        from tristream.vision.vit import VisionTower, VisionTowerConfig

        torch.manual_seed(0)
        dt = torch.float16 if device.startswith("cuda") else torch.float32
        vcfg = (VisionTowerConfig("siglip", 64, 128, 2, 4, 32, 8) if tiny
                else VisionTowerConfig("siglip", 768, 3072, 12, 12, 224, 16))
        self.tower = VisionTower(vcfg).to(device=device, dtype=dt).eval()
        side = vcfg.image_size
        self.pixels = torch.randn(IMAGE_BUCKETS[-1], 3, side, side, device=device, dtype=dt)
        self.vision = VisionGraphBank(lambda px: self.tower(px).features, (3, side, side),
                                      buckets=IMAGE_BUCKETS, device=device, dtype=dt)
        dims: WhisperDims = WhisperDims(64, 1, 1, 2, 128) if tiny else whisper_preset("tiny")
        self.whisper = Whisper(dims).to(device=device, dtype=dt).eval()
        self.asr = WhisperRunner(self.whisper, WhisperTokens.for_vocab(dims.vocab_size), batch_buckets=ASR_BUCKETS,
                                 audio_buckets_s=(asr_window_s,), max_new_tokens=asr_tokens, chunk=asr_tokens,
                                 early_stop=False, word_times=False)
        n = int(asr_window_s * 16000)  # the store holds one window per stream
        self.store = AudioStore(ASR_BUCKETS[-1], n, device)
        rng = np.random.default_rng(0)
        self.slots = [self.store.acquire() for _ in range(ASR_BUCKETS[-1])]
        for s in self.slots:
            self.store.append(s, (0.1 * rng.standard_normal(n)).astype(np.float32))
        self.images = 0
        self.asr_passes = 0

    def capture(self) -> None:
        """Capture every bucket's graphs now (start-up, never while serving)."""
        self.vision.capture()
        self.asr.capture()

    def encode_images(self, n: int) -> Any:
        """Encode n frames (asynchronous on CUDA: graph replays, no sync)."""
        out = None
        for i in range(0, n, IMAGE_BUCKETS[-1]):
            k = min(IMAGE_BUCKETS[-1], n - i)
            out = self.vision(self.pixels[:k])
        self.images += n
        return out

    def asr_update(self, n: int) -> None:
        """n streaming ASR updates (one pass per ≤16 streams; tokens reach the host once per pass)."""
        for i in range(0, n, ASR_BUCKETS[-1]):
            k = min(ASR_BUCKETS[-1], n - i)
            self.asr.run_store(self.store, self.slots[:k])
            self.asr_passes += 1


@dataclass(slots=True)
class RealStats:
    """Consistency counters between the plan and what the engine did."""

    steps: int = 0
    first_tokens: int = 0
    decode_tokens: int = 0
    missing_first_token: int = 0
    unplanned_tokens: int = 0
    cancelled: int = 0
    samples: list[tuple[int, int, int, int, float]] = field(default_factory=list)
    phases: list[dict[str, tuple[float, float]]] = field(default_factory=list)


class RealEngineBackend:
    """EngineBackend over an `LLMEngine` (+ optional graphed vision / ASR load)."""

    def __init__(self, engine: Any, encoders: Any | None = None, prefix_tokens: int = 64, seed: int = 0,
                 profile: bool = True) -> None:
        """encoders: an `EncoderLoad` (or None: images and ASR units cost nothing);
        profile: keep the per-phase breakdown of every step."""
        self.engine = engine
        self.encoders = encoders
        self.profile = profile
        self.rng = random.Random(seed)
        vocab = int(engine.model.cfg.vocab_size)
        self._lo, self._hi = min(10, vocab - 1), vocab - 1
        self.prefix = [self.rng.randint(self._lo, self._hi) for _ in range(prefix_tokens)]
        self.seq_of: dict[int, int] = {}
        """session → engine sequence of its current turn."""
        self.generating: set[int] = set()
        self._to_cancel: list[int] = []
        self._cuda = engine.model.device.type == "cuda"
        self.sched_ns = 0
        """Host time the scheduler spent since the last step (plan + complete); see `time_scheduler`."""
        self.stats = RealStats()

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randint(self._lo, self._hi) for _ in range(n)]

    def _cancel(self, sid: int) -> None:
        seq = self.seq_of.pop(sid, None)
        self.generating.discard(sid)
        if seq is not None:
            self.engine.cancel(seq)
            self._to_cancel.append(seq)
            self.stats.cancelled += 1

    def release(self, session_id: int) -> None:
        """Session closed: free its context."""
        self._cancel(session_id)

    def execute(self, plan: BatchPlan, now_ns: int) -> StepResult:
        """Run the plan on the GPU (or CPU) and time it."""
        import torch

        from tristream.engine.sequence import SamplingParams

        eng = self.engine
        t0 = time.perf_counter_ns()
        tm = PhaseTimer(use_events=self._cuda and self.profile)
        if self.profile:
            tm.mark("backend")
        budget = 0
        want_first: dict[int, int] = {}
        decode_seqs: set[int] = set()
        planned: set[int] = set()
        for e in plan.entries:
            it, sid = e.item, e.item.session_id
            if it.kind in (Kind.PREFILL, Kind.TURN_END):
                if sid in self.generating:  # the user barged in: the old answer's context goes
                    self._cancel(sid)
                seq = self.seq_of.get(sid)
                if seq is None:
                    seq = eng.add_request(self.prefix + self._tokens(e.tokens), generate=False, priority=1)
                    self.seq_of[sid] = seq
                    budget += len(self.prefix)
                elif e.tokens > 0:
                    eng.append(seq, token_ids=self._tokens(e.tokens))
                budget += e.tokens
                planned.add(seq)
                if it.kind is Kind.TURN_END and e.completes:
                    answer = max(1, int(it.meta.get("answer", 1)))
                    eng.start_generation(seq, SamplingParams(max_tokens=answer, ignore_eos=True))
                    self.generating.add(sid)
                    want_first[seq] = it.item_id
            elif it.kind is Kind.DECODE and sid in self.seq_of:
                decode_seqs.add(self.seq_of[sid])
        planned |= decode_seqs
        enc = self.encoders
        if plan.asr_units and enc is not None:
            if self.profile:
                tm.mark("asr")
            enc.asr_update(plan.asr_units)
        if plan.images and enc is not None:
            if self.profile:
                tm.mark("vision")
            enc.encode_images(plan.images)
        outs = []
        if planned or self._to_cancel:
            if self.profile:
                tm.mark("engine")
                eng.timer = tm
            try:
                # a turn end with one pending token runs as a decode row: leave room for it
                outs = eng.step(allow=planned, max_batch=max(1, len(decode_seqs | set(want_first))),
                                max_prefill_tokens=max(1, budget))
            finally:
                eng.timer = None
        if self._cuda:
            if self.profile:
                tm.mark("sync")
            torch.cuda.synchronize()
        if self.profile:
            tm.mark("backend")
        self._to_cancel = []
        finished: set[int] = set()
        by_seq = {s: sid for sid, s in self.seq_of.items()}
        got_first = set()
        for o in outs:
            if o.token_id is None:
                continue
            if o.seq_id in want_first:
                self.stats.first_tokens += 1
                got_first.add(o.seq_id)
            elif o.seq_id in decode_seqs:
                self.stats.decode_tokens += 1
            else:
                self.stats.unplanned_tokens += 1
            if o.finished:
                owner = by_seq.get(o.seq_id)
                if owner is not None:
                    self.seq_of.pop(owner, None)
                    self.generating.discard(owner)
                    if o.finish_reason is not None and o.finish_reason.name in ("EOS", "STOP"):
                        finished.add(owner)  # ended before its planned length: the scheduler drops the rest
        self.stats.missing_first_token += len(set(want_first) - got_first)
        self.stats.steps += 1
        t1 = time.perf_counter_ns()
        dur = t1 - t0
        if self.profile:
            tm.close()
            ph = tm.phases()
            ph["sched"] = (self.sched_ns / 1e6, float("nan"))
            self.stats.phases.append(ph)
        self.sched_ns = 0
        self.stats.samples.append((plan.decode, plan.prefill_tokens, plan.images, plan.asr_units, dur / 1e6))
        return StepResult(duration_ns=max(1, dur), finished_sessions=finished)


def time_scheduler(sched: Any, backend: RealEngineBackend) -> None:
    """Count the scheduler's `plan` and `complete` host time into the backend's next step breakdown."""
    plan_fn, complete_fn = sched.plan, sched.complete

    def plan(now_ns: int) -> Any:
        t = time.perf_counter_ns()
        try:
            return plan_fn(now_ns)
        finally:
            backend.sched_ns += time.perf_counter_ns() - t

    def complete(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return complete_fn(*args, **kw)
        finally:
            backend.sched_ns += time.perf_counter_ns() - t

    sched.plan, sched.complete = plan, complete


def build_encoders(device: str, tiny: bool = False) -> Any:
    """Graphed SigLIP-B/16 + Whisper-tiny load with random weights (fp16 on GPU), captured."""
    enc = EncoderLoad(device, tiny=tiny)
    enc.capture()
    return enc
