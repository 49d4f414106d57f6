"""Batched Whisper transcription passes on fixed shape buckets, CUDA-graphed on a GPU.

One pass takes the audio buffers of many streams, pads them into one `(batch bucket, audio
bucket)` shape, computes log-mel, runs the encoder, fills the static cross-attention K/V,
prefills the task prompt and then greedy-decodes `max_new_tokens` tokens with a static
self-attention KV. Two graphs per bucket: "encode" (encoder + cross K/V + prompt prefill + first
token) and "steps" (`chunk` decoder steps unrolled). All buckets share one memory pool and one
set of static buffers (sliced per bucket), captured largest first. Tokens and the encoder frame
each token attends to leave the GPU once per pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tristream.engine.speech.audio_store import AudioStore
from tristream.engine.speech.config import HOP, SAMPLE_RATE, WhisperTokens
from tristream.engine.speech.errors import AudioInputError
from tristream.engine.speech.mel import LogMel
from tristream.engine.speech.whisper import DecoderCache, Whisper

SAMPLES_PER_POSITION = 2 * HOP


@dataclass(slots=True)
class PassResult:
    """Greedy tokens `[B, K]` (text ids, EOT-terminated or full) and each token's encoder frame `[B, K]`."""

    tokens: np.ndarray
    frames: np.ndarray
    audio_bucket_s: float
    batch_bucket: int


@dataclass(slots=True)
class RunnerStats:
    """Counters: passes per bucket, eager passes, graph captures."""

    passes: dict[tuple[int, float], int] = field(default_factory=dict)
    captured: int = 0
    eager_passes: int = 0


class WhisperRunner:
    """Fixed-bucket batched Whisper passes (graphs on CUDA, eager elsewhere or when disabled)."""

    def __init__(
        self,
        model: Whisper,
        tokens: WhisperTokens,
        *,
        batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
        audio_buckets_s: tuple[float, ...] = (5.0, 10.0, 20.0, 30.0),
        max_new_tokens: int = 24,
        chunk: int = 8,
        use_graphs: bool | None = None,
        early_stop: bool = True,
    ) -> None:
        self.model = model.eval()
        self.tokens = tokens
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.audio_buckets = tuple(sorted(audio_buckets_s))
        for s in self.audio_buckets:
            n = int(round(s * SAMPLE_RATE))
            if n % SAMPLES_PER_POSITION or n // SAMPLES_PER_POSITION > model.dims.max_source_positions:
                raise AudioInputError(f"audio bucket {s} s must be a multiple of 20 ms and at most 30 s")
        self.prompt = tokens.prompt()
        self.k = max_new_tokens
        self.chunk = max(1, min(chunk, max_new_tokens))
        t_max = len(self.prompt) + self.k + self.chunk
        if t_max > model.dims.max_target_positions:
            raise AudioInputError(f"prompt + max_new_tokens + chunk = {t_max} exceeds the decoder's "
                                  f"{model.dims.max_target_positions} positions")
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.early_stop = early_stop
        self.stats = RunnerStats()
        bmax = self.batch_buckets[-1]
        smax = int(round(self.audio_buckets[-1] * SAMPLE_RATE))
        dev = self.device
        self.mel = LogMel(model.dims.n_mels).to(dev)
        self.audio = torch.zeros(bmax, smax, device=dev)
        self.mel_buf = torch.zeros(bmax, model.dims.n_mels, smax // HOP, device=dev, dtype=self.dtype)
        self.cache = model.new_cache(bmax, smax // SAMPLES_PER_POSITION, t_max, device=dev, dtype=self.dtype)
        self.prompt_ids = torch.tensor(self.prompt, device=dev)
        self.prompt_pos = torch.arange(len(self.prompt), device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.out_base = torch.full((1,), len(self.prompt), dtype=torch.long, device=dev)
        self.tok = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.out_tok = torch.full((bmax, self.k + self.chunk + 1), tokens.eot, dtype=torch.long, device=dev)
        self.out_frame = torch.zeros(bmax, self.k + self.chunk + 1, dtype=torch.long, device=dev)
        self._graphs: dict[tuple[str, int, float], torch.cuda.CUDAGraph] = {}
        self._pool: object | None = None

    # ---- bucket selection ------------------------------------------------------------------
    def batch_bucket(self, n: int) -> int:
        """Smallest batch bucket holding `n` streams."""
        for b in self.batch_buckets:
            if b >= n:
                return b
        raise AudioInputError(f"{n} streams exceed the largest batch bucket {self.batch_buckets[-1]}; "
                              "split them over several passes")

    def audio_bucket(self, n_samples: int) -> float:
        """Smallest audio bucket (seconds) holding `n_samples`."""
        for s in self.audio_buckets:
            if s * SAMPLE_RATE >= n_samples:
                return s
        raise AudioInputError(f"{n_samples / SAMPLE_RATE:.2f} s of audio exceed the largest bucket "
                              f"{self.audio_buckets[-1]} s; trim the stream's buffer")

    def _views(self, bb: int, ab: float) -> tuple[torch.Tensor, DecoderCache]:
        n = int(round(ab * SAMPLE_RATE))
        t = n // SAMPLES_PER_POSITION
        return self.mel_buf[:bb, :, : n // HOP], self.cache.rows(bb, t)

    # ---- the two captured regions ------------------------------------------------------------
    def _encode(self, bb: int, ab: float) -> None:
        mel, cache = self._views(bb, ab)
        m = self.model
        enc = m.encode(mel)
        m.fill_cross(enc, cache)
        logits, _ = m.decode(self.prompt_ids.expand(bb, -1), self.prompt_pos, cache, vocab_limit=self.tokens.sot)
        self.tok[:bb].copy_(logits[:, -1].argmax(-1))
        self.out_tok[:bb, 0].copy_(self.tok[:bb])
        self.pos.copy_(self.out_base)

    def _steps(self, bb: int, ab: float) -> None:
        _, cache = self._views(bb, ab)
        m = self.model
        sot = self.tokens.sot
        for _ in range(self.chunk):
            logits, align = m.decode(self.tok[:bb, None], self.pos, cache, vocab_limit=sot)
            nxt = logits[:, 0].argmax(-1)
            j = self.pos - self.out_base
            self.out_frame[:bb].index_copy_(1, j, align[:, 0].argmax(-1, keepdim=True))
            self.out_tok[:bb].index_copy_(1, j + 1, nxt[:, None])
            self.tok[:bb].copy_(nxt)
            self.pos.add_(1)

    def _run(self, kind: str, bb: int, ab: float) -> None:
        fn = self._encode if kind == "encode" else self._steps
        if not self.use_graphs:
            fn(bb, ab)
            return
        key = (kind, bb, ab)
        g = self._graphs.get(key)
        if g is None:
            self.capture()
            g = self._graphs[key]
        g.replay()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch, audio) bucket's two graphs, largest first, into one pool."""
        if not self.use_graphs or self._graphs:
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._encode(self.batch_buckets[-1], self.audio_buckets[-1])
                self._steps(self.batch_buckets[-1], self.audio_buckets[-1])
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        for ab in reversed(self.audio_buckets):
            for bb in reversed(self.batch_buckets):
                for kind, fn in (("encode", self._encode), ("steps", self._steps)):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self._pool):
                        fn(bb, ab)
                    self._graphs[(kind, bb, ab)] = g
                    self.stats.captured += 1
        torch.cuda.synchronize(self.device)

    # ---- one pass ----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, audio: list[np.ndarray]) -> PassResult:
        """Transcribe each host buffer (float32 16 kHz mono, ≤ largest bucket) in one batched pass."""
        if not audio:
            raise AudioInputError("run() needs at least one audio buffer")
        bb = self.batch_bucket(len(audio))
        ab = self.audio_bucket(max(a.shape[0] for a in audio))
        n = int(round(ab * SAMPLE_RATE))
        host = np.zeros((bb, n), np.float32)
        for i, a in enumerate(audio):
            if a.ndim != 1:
                raise AudioInputError(f"audio buffer {i} has shape {a.shape}; expected mono [samples]")
            host[i, : a.shape[0]] = a
        src = torch.from_numpy(host)
        if self.device.type == "cuda":
            src = src.pin_memory()
        self.audio[:bb, :n].copy_(src, non_blocking=True)
        return self._pass(len(audio), bb, ab)

    @torch.inference_mode()
    def run_store(self, store: AudioStore, slots: list[int]) -> PassResult:
        """Transcribe device-resident rows of `store` in one batched pass (no host audio copy)."""
        if not slots:
            raise AudioInputError("run_store() needs at least one slot")
        bb = self.batch_bucket(len(slots))
        ab = self.audio_bucket(int(max(store.lengths[s] for s in slots)))
        n = int(round(ab * SAMPLE_RATE))
        idx = torch.tensor(slots, device=store.device)
        self.audio[: len(slots), :n].copy_(store.buf[:, :n].index_select(0, idx))
        return self._pass(len(slots), bb, ab)

    def _pass(self, n_real: int, bb: int, ab: float) -> PassResult:
        n = int(round(ab * SAMPLE_RATE))
        self.mel_buf[:bb, :, : n // HOP].copy_(self.mel(self.audio[:bb, :n]))
        self.out_tok.fill_(self.tokens.eot)
        self._run("encode", bb, ab)
        done = 0
        while done < self.k:
            self._run("steps", bb, ab)
            done += self.chunk
            if self.early_stop and done < self.k:
                if bool((self.out_tok[:n_real, : done + 1] == self.tokens.eot).any(1).all()):
                    break
        toks = self.out_tok[:n_real, : self.k].cpu().numpy().copy()
        frames = self.out_frame[:n_real, : self.k].cpu().numpy().copy()
        key = (bb, ab)
        self.stats.passes[key] = self.stats.passes.get(key, 0) + 1
        if not self.use_graphs:
            self.stats.eager_passes += 1
        return PassResult(toks, frames, ab, bb)
