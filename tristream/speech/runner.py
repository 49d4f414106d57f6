"""Batched Whisper transcription passes on fixed shape buckets, CUDA-graphed on a GPU.

One pass takes the audio buffers of many streams, pads them into one `(batch bucket, audio
bucket)` shape, computes log-mel, runs the encoder, fills the static cross-attention K/V,
prefills the task prompt plus each stream's draft (its previous hypothesis) in parallel, keeps
the agreeing draft prefix, then greedy-decodes the rest with a static self-attention KV, every
sequence at its own position. Four kinds of graph per bucket: "encode" (log-mel + encoder + cross
K/V: audio only, so it runs while the host writes the pass's inputs), "prefill" (prompt + draft
prefill + draft acceptance + first token), "steps{n}" (n = 1 … `chunk` decoder steps unrolled,
argmax on the device; the host reads a done flag and the steps left once per chunk) and "align"
(teacher-forced alignment-heads pass → word-timing matrix, and DTW on the device where Triton
runs). All buckets share one memory pool and one set of static buffers (sliced per bucket),
captured largest first. Tokens and token times leave the GPU once per pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tristream.engine.graph_capture import capture_buckets
from tristream.speech import dtw_device, kernels
from tristream.speech.audio_store import AudioStore
from tristream.speech.config import SAMPLE_RATE, WhisperTokens
from tristream.speech.errors import AudioInputError
from tristream.speech.mel import LogMel
from tristream.speech.pass_io import (
    COLS,
    SAMPLES_PER_POSITION,
    PassInputs,
    PassResult,
    RunnerStats,
    valid_frames,
)
from tristream.speech.timing import alignment_matrix, anchored_token_starts
from tristream.speech.whisper import DecoderCache, Whisper


class WhisperRunner:
    """Fixed-bucket batched Whisper passes (graphs on CUDA, eager elsewhere or when disabled).

    Drafts: a stream may hand its previous hypothesis (text token ids) as a draft. The prefill runs
    prompt + draft in parallel, keeps the longest draft prefix the model's own greedy choice agrees
    with (exactly what step-by-step greedy decoding would produce) and continues step by step from
    there, every sequence at its own position. In steady streaming only the new tail is decoded.
    """

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
        max_draft: int = 0,
        word_times: bool = True,
        retime: int = 4,
        silence_db: float = 35.0,
        device_times: bool | None = None,
        fused_kernels: bool | None = None,
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
        if not 0 <= max_draft < max_new_tokens:
            raise AudioInputError(f"max_draft {max_draft} must be in [0, max_new_tokens={max_new_tokens})")
        self.max_draft = max_draft
        self.chunk = max(1, min(chunk, max_new_tokens))
        self.word_times = word_times
        self.retime = max(1, retime)
        self.silence_db = silence_db
        n_prompt = len(self.prompt)
        t_max = -(-(n_prompt + self.k + 1) // 16) * 16  # rounded up: aligned attention-mask rows
        if n_prompt + self.k + 1 > model.dims.max_target_positions:
            raise AudioInputError(f"prompt + max_new_tokens + 1 = {n_prompt + self.k + 1} exceeds the decoder's "
                                  f"{model.dims.max_target_positions} positions")
        t_max = min(t_max, model.dims.max_target_positions)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.early_stop = early_stop
        self.stats = RunnerStats()
        bmax = self.batch_buckets[-1]
        smax = int(round(self.audio_buckets[-1] * SAMPLE_RATE))
        tmax_enc = smax // SAMPLES_PER_POSITION
        dev = self.device
        self.t_max = t_max
        self.mel = LogMel(model.dims.n_mels).to(dev)
        self.audio = torch.zeros(bmax, smax, device=dev)
        self.cache = model.new_cache(bmax, tmax_enc, t_max, device=dev, dtype=self.dtype)
        self.prompt_ids = torch.tensor(self.prompt, device=dev)
        self.pass_in = t = PassInputs(bmax, max_draft, tokens.eot, dev)
        self.valid_frames, self.draft_len, self.real, self.draft = t.valid_frames, t.draft_len, t.real, t.draft
        self.n_draft_frames, self.draft_frames = t.n_draft_frames, t.draft_frames
        pin = dev.type == "cuda"
        # audio-store rows of a `run_store` pass, uploaded before the inputs (the gather feeds "encode")
        self._slots_dev = torch.zeros(bmax, dtype=torch.long, device=dev)
        self._slots_host = torch.zeros(bmax, dtype=torch.long, pin_memory=pin)
        self._slots_copied: torch.cuda.Event | None = None
        self._host_out = torch.zeros(bmax, 2 * max_new_tokens + 3, dtype=torch.long, pin_memory=pin)
        self._host_db = torch.zeros(bmax, tmax_enc, pin_memory=pin)
        self.pos = torch.zeros(bmax, dtype=torch.long, device=dev)  # next input position, per sequence
        self.tok = torch.zeros(bmax, dtype=torch.long, device=dev)
        # what a pass returns, one int64 table read back with one copy (no gather kernel): tokens (+ the
        # overflow column), accepted draft length, token start frames (+ the end-of-text row)
        self._out = torch.zeros(bmax, 2 * self.k + 3, dtype=torch.long, device=dev)
        self.out_tok = self._out[:, : self.k + 1]  # last col: overflow
        self.out_tok.fill_(tokens.eot)
        self.accepted = self._out[:, self.k + 1]
        self.frames = self._out[:, self.k + 2 :]
        self.cols = torch.arange(self.k, device=dev)
        self.frame_db = torch.zeros(bmax, tmax_enc, device=dev)
        # [all rows done, most serial steps any unfinished row can still use]: read once per chunk
        self.status = torch.zeros(2, dtype=torch.long, device=dev)
        self.align = torch.zeros(bmax, self.k + 1, tmax_enc, device=dev, dtype=torch.float32)
        # token start frames by DTW in the align graph (dtw_device), read with the tokens; else on the host
        self.device_times = (dev.type == "cuda" and dtw_device.available()) if device_times is None else device_times
        if self.device_times and not dtw_device.available():
            raise AudioInputError("device_times=True needs Triton; install it or pass device_times=False")
        self._dtw_ws = ((torch.zeros_like(self.align), torch.zeros_like(self.align)) if self.device_times
                        else (self.align[:0], self.align[:0]))
        # decoder step kernels (speech/kernels.py: fused add + layer norm, K/V write, split argmax and
        # the step's bookkeeping); default on where Triton runs on this device, TRISTREAM_WHISPER_KERNELS=0 off
        if fused_kernels is None:
            fused_kernels = os.environ.get("TRISTREAM_WHISPER_KERNELS", "1") != "0" and dev.type == "cuda"
        self.fused_kernels = bool(fused_kernels) and kernels.enabled(t.table)
        self._last: tuple[list[int], float, np.ndarray, np.ndarray] = ([], 0.0, np.zeros((0, 0)), np.zeros(0))
        self._graphs: dict[tuple[float, int, str], torch.cuda.CUDAGraph] = {}  # (audio s, batch, kind)
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
        return self.audio[:bb, :n], self.cache.rows(bb, n // SAMPLES_PER_POSITION)

    # ---- the captured regions --------------------------------------------------------------
    def _encode(self, bb: int, ab: float) -> None:
        """Log-mel, encoder, cross K/V: reads the audio only (not the pass's input table)."""
        audio, cache = self._views(bb, ab)
        m = self.model
        t = audio.shape[1] // SAMPLES_PER_POSITION
        if self.word_times:  # loudness of every 20 ms frame (snapping word edges onto pauses)
            power = audio.view(bb, t, -1).square().mean(-1)
            self.frame_db[:bb, :t].copy_(10.0 * torch.log10(power + 1e-10))
        enc = m.encode(self.mel(audio).to(self.dtype), fused=self.fused_kernels)
        m.fill_cross(enc, cache)

    def _prefill(self, bb: int, ab: float) -> None:
        """Parallel prefill of prompt + draft, draft acceptance, first new token."""
        _, cache = self._views(bb, ab)
        m = self.model
        n_prompt, d = len(self.prompt), self.max_draft
        ids = torch.cat([self.prompt_ids.expand(bb, -1), self.draft[:bb]], dim=1)
        pos = torch.arange(n_prompt + d, device=self.device)
        logits = m.decode(ids, pos, cache, vocab_limit=self.tokens.sot, logits_from=n_prompt - 1,
                          fused=self.fused_kernels)
        greedy = kernels.argmax(logits) if self.fused_kernels else logits.argmax(-1)
        j = torch.arange(d, device=self.device)
        agree = (greedy[:, :d] == self.draft[:bb]) & (j[None, :] < self.draft_len[:bb, None])
        acc = agree.long().cumprod(dim=1).sum(dim=1)  # [bb] longest agreeing draft prefix
        nxt = greedy.gather(1, acc[:, None])  # the model's own token after it
        out = self.out_tok[:bb]
        out.fill_(self.tokens.eot)
        out[:, :d].copy_(torch.where(j[None, :] < acc[:, None], self.draft[:bb], self.tokens.eot))
        out.scatter_(1, acc[:, None], nxt)
        self.accepted[:bb].copy_(acc)
        self.tok[:bb].copy_(nxt[:, 0])
        self.pos[:bb].copy_(acc + n_prompt)
        self._set_done(bb)

    def _set_done(self, bb: int) -> None:
        written = self.pos[:bb] - len(self.prompt)  # last written column per sequence
        row_done = (written >= self.k - 1) | (self.real[:bb] == 0)
        if self.early_stop:
            row_done |= ((self.out_tok[:bb, : self.k] == self.tokens.eot) & (self.cols[None, :] <= written[:, None])).any(1)
        self.status[0] = row_done.all()
        self.status[1] = torch.where(row_done, 0, self.k - 1 - written).amax()

    def _steps(self, bb: int, ab: float, n: int) -> None:
        """`n` greedy steps, each sequence at its own position (clamped at the buffer's end)."""
        _, cache = self._views(bb, ab)
        m = self.model
        n_prompt = len(self.prompt)
        for _ in range(n):
            pos = self.pos[:bb]
            logits = m.decode(self.tok[:bb, None], pos[:, None], cache, vocab_limit=self.tokens.sot,
                              fused=self.fused_kernels)
            if self.fused_kernels:  # argmax, token column, next input and position: two kernels
                kernels.greedy_step(logits[:, 0], self.out_tok[:bb], self.tok[:bb], pos, n_prompt, self.k, self.t_max)
                continue
            nxt = logits[:, 0].argmax(-1)
            col = (pos - n_prompt + 1).clamp_(max=self.k)  # column k is the overflow slot
            self.out_tok[:bb].scatter_(1, col[:, None], nxt[:, None])
            self.tok[:bb].copy_(nxt)
            pos.add_(1).clamp_(max=self.t_max - 1)
        self._set_done(bb)

    def _align(self, bb: int, ab: float) -> None:
        """Teacher-forced pass over prompt + tokens → alignment matrix rows `[bb, K + 1, T]`."""
        _, cache = self._views(bb, ab)
        n_prompt = len(self.prompt)
        out = self.out_tok[:bb, : self.k]
        ids = torch.cat([self.prompt_ids.expand(bb, -1), out], dim=1)
        logits = self.model.alignment_logits(ids, cache, fused=self.fused_kernels)  # [bb, heads, P + K, T]
        is_eot = out == self.tokens.eot
        n_text = torch.where(is_eot.any(1), is_eot.long().argmax(1), self.k)
        rows = torch.arange(n_prompt + self.k, device=self.device)[None, :] <= (n_text + n_prompt)[:, None]
        mat = alignment_matrix(logits, self.valid_frames[:bb], rows)
        self.align[:bb, :, : mat.shape[-1]].copy_(mat[:, n_prompt - 1 :])
        if self.device_times:
            dtw_device.device_token_starts(
                self.align[:bb, :, : mat.shape[-1]], out, self.tokens.eot, self.valid_frames[:bb], self.accepted[:bb],
                self.draft_frames[:bb], self.n_draft_frames[:bb], self.retime, self.frames[:bb],
                (self._dtw_ws[0][:bb], self._dtw_ws[1][:bb]))

    def _fn(self, kind: str) -> Callable[[int, float], None]:
        if kind.startswith("steps"):
            n = int(kind[5:])
            return lambda bb, ab: self._steps(bb, ab, n)
        return {"encode": self._encode, "prefill": self._prefill, "align": self._align}[kind]

    def _step_sizes(self) -> tuple[int, ...]:
        """Step-graph sizes: powers of two below `chunk`, and `chunk` (any count up to it is a sum of them)."""
        sizes = {self.chunk}
        n = 1
        while n < self.chunk:
            sizes.add(n)
            n *= 2
        return tuple(sorted(sizes, reverse=True))

    def _kinds(self) -> tuple[str, ...]:
        """Graph kinds per bucket: encode, prefill, `steps{n}` for each step size (a pass never runs a
        step that no row can use: the last chunk is cut to the steps left), align (with word times)."""
        steps = tuple(f"steps{n}" for n in self._step_sizes())
        return ("encode", "prefill", *steps, "align") if self.word_times else ("encode", "prefill", *steps)

    @torch.inference_mode()
    def _run(self, kind: str, bb: int, ab: float) -> None:
        if not self.use_graphs:
            self._fn(kind)(bb, ab)
            return
        key = (ab, bb, kind)
        g = self._graphs.get(key)
        if g is None:
            self.capture()
            g = self._graphs[key]
        g.replay()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch, audio) bucket's graphs (encode, steps, align), largest first, into one pool."""
        if not self.use_graphs or self._graphs:
            return
        largest = (self.audio_buckets[-1], self.batch_buckets[-1])
        kinds = self._kinds()

        def warm(key: tuple[float, int, int]) -> None:
            ab, bb, k = key
            if k == len(kinds) - 1:  # "encode": the log-mel's cuFFT plan of every bucket shape, made eagerly
                self.mel(self._views(bb, ab)[0])  # (a plan first made inside a capture would record its setup)
            if (ab, bb) == largest:
                self._fn(kinds[-1 - k])(bb, ab)

        # keys sort largest bucket first and, within a bucket, in pass order (encode, prefill, steps,
        # align): the warm-up's steps then start from a prefilled state
        keys = [(ab, bb, len(kinds) - 1 - i) for ab in self.audio_buckets for bb in self.batch_buckets
                for i in range(len(kinds))]
        with torch.cuda.device(self.device):
            graphs, _, self._pool = capture_buckets(keys, lambda key: self._fn(kinds[-1 - key[2]])(key[1], key[0]),
                                                    warm=warm)
        self._graphs = {(ab, bb, kinds[-1 - k]): g for (ab, bb, k), g in graphs.items()}
        self.stats.captured += len(self._graphs)

    # ---- one pass ----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, audio: list[np.ndarray], drafts: Sequence[Sequence[int]] | None = None,
            draft_frames: Sequence[Sequence[int]] | None = None, word_times: bool | None = None) -> PassResult:
        """Transcribe each host buffer (float32 16 kHz mono, ≤ largest bucket) in one batched pass.

        `drafts[i]`: optional previous hypothesis of stream i (text token ids), see the class doc;
        `draft_frames[i]`: that hypothesis's token start frames (previous `PassResult.frames` row), so
        only the tail is re-timed.
        """
        if not audio:
            raise AudioInputError("run() needs at least one audio buffer")
        self._check_counts(len(audio), drafts, draft_frames)
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
        lengths = [a.shape[0] for a in audio]
        self._run("encode", bb, ab)  # the GPU starts on the audio while the host writes the inputs
        self._set_inputs(lengths, bb, drafts, None, draft_frames)
        return self._pass(lengths, bb, ab, word_times, draft_frames)

    @torch.inference_mode()
    def run_store(self, store: AudioStore, slots: list[int], drafts: Sequence[Sequence[int]] | None = None,
                  draft_frames: Sequence[Sequence[int]] | None = None, word_times: bool | None = None) -> PassResult:
        """Transcribe device-resident rows of `store` in one batched pass (no host audio copy).

        `word_times=False` skips the alignment pass (frames all 0, `voiced` None); `align_rows`
        then times just the rows that need it, afterwards."""
        if not slots:
            raise AudioInputError("run_store() needs at least one slot")
        self._check_counts(len(slots), drafts, draft_frames)
        if store.device.type != self.device.type:
            raise AudioInputError(f"audio store on {store.device}, runner on {self.device}; build them on one device")
        bb = self.batch_bucket(len(slots))
        lengths = [int(store.lengths[s]) for s in slots]
        ab = self.audio_bucket(max(lengths))
        n = int(round(ab * SAMPLE_RATE))
        m = len(slots)
        if self._slots_copied is not None:
            self._slots_copied.synchronize()  # normally long complete (the last pass ended with a read)
        self._slots_host[:m].numpy()[:] = slots
        self._slots_dev[:m].copy_(self._slots_host[:m], non_blocking=True)
        if self.device.type == "cuda":
            self._slots_copied = torch.cuda.Event()
            self._slots_copied.record()
        self.audio[:m, :n].copy_(store.buf[:, :n].index_select(0, self._slots_dev[:m]))
        self._run("encode", bb, ab)  # the GPU starts on the audio while the host writes the inputs
        self._set_inputs(lengths, bb, drafts, slots, draft_frames)
        return self._pass(lengths, bb, ab, word_times, draft_frames)

    def _set_inputs(self, lengths: list[int], bb: int, drafts: Sequence[Sequence[int]] | None,
                    slots: Sequence[int] | None = None, draft_frames: Sequence[Sequence[int]] | None = None) -> None:
        """The pass's input table (`PassInputs.write`); draft frames only where DTW runs on the device."""
        cut, written = self.pass_in.write(lengths, bb, drafts, slots, draft_frames if self.device_times else None)
        self.stats.truncated_drafts += cut
        self.stats.draft_tokens += written

    @staticmethod
    def _check_counts(m: int, drafts: Sequence[Sequence[int]] | None,
                      draft_frames: Sequence[Sequence[int]] | None) -> None:
        """One draft (and one frame list) per stream, checked before any GPU work is queued."""
        if drafts is not None and len(drafts) != m:
            raise AudioInputError(f"{len(drafts)} drafts for {m} streams; pass one per stream")
        if draft_frames is not None and len(draft_frames) != m:
            raise AudioInputError(f"{len(draft_frames)} draft frame lists for {m} streams; pass one per stream")

    def _read(self, n_real: int, t: int, with_db: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """The pass's output table (a copy: `[n_real, 2K + 3]`, see `_out`) and, `with_db`, the frame
        loudness `[n_real, t]` (valid until the next pass): whole rows into preallocated pinned
        buffers, one wait."""
        if self.device.type != "cuda":
            return (self._out[:n_real].cpu().numpy().copy(),
                    self.frame_db[:n_real, :t].cpu().numpy().copy() if with_db else None)
        self._host_out[:n_real].copy_(self._out[:n_real], non_blocking=True)
        if with_db:
            self._host_db[:n_real].copy_(self.frame_db[:n_real], non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return self._host_out[:n_real].numpy().copy(), self._host_db[:n_real, :t].numpy() if with_db else None

    def _token_times(self, toks: np.ndarray, accepted: np.ndarray, lengths: list[int],
                     draft_frames: Sequence[Sequence[int]] | None, align: torch.Tensor | None = None) -> np.ndarray:
        return anchored_token_starts(self.align if align is None else align, toks, self.tokens.eot,
                                     valid_frames(lengths), accepted,
                                     draft_frames, self.retime)

    def _pass(self, lengths: list[int], bb: int, ab: float, word_times: bool | None = None,
              draft_frames: Sequence[Sequence[int]] | None = None) -> PassResult:
        """The rest of a pass whose audio is encoded (or queued) and whose inputs are set."""
        timed = self.word_times if word_times is None else word_times and self.word_times
        n_real = len(lengths)
        n = int(round(ab * SAMPLE_RATE))
        self._run("prefill", bb, ab)
        steps = 0
        # one sync per chunk: the graphs leave `status` = (every real stream has written end-of-text
        # (early_stop) or filled its K columns, most steps a row can still use); read after the
        # prefill too, since a fully accepted draft may already end in end-of-text
        while steps < self.k:
            done, left = self.status.tolist()
            if done or left <= 0:
                break
            n_steps = min(self.chunk, left)
            todo = n_steps
            for size in self._step_sizes():  # e.g. 3 = 2 + 1, replayed back to back without a read
                while size <= todo:
                    self._run(f"steps{size}", bb, ab)
                    todo -= size
            steps += n_steps
            if n_steps == left:  # every row has now filled its K columns: no need to ask the device
                break
        if timed:
            self._run("align", bb, ab)
        on_device = timed and self.device_times
        packed, db = self._read(n_real, n // SAMPLES_PER_POSITION, timed)  # tokens, frames, loudness: one wait
        toks, accepted = packed[:, : self.k], packed[:, self.k + 1]
        frames = np.zeros((n_real, self.k + 1), np.int64)
        voiced: np.ndarray | None = None
        self._last = (lengths, ab, toks, accepted)
        if timed:
            frames = packed[:, self.k + 2 :] if on_device else self._token_times(toks, accepted, lengths, draft_frames)
            assert db is not None
            voiced = db > (db.max(axis=1, keepdims=True) - self.silence_db)
            self.stats.align_passes += 1
            self.stats.aligned_rows += n_real
        else:
            self.stats.deferred_rows += n_real
        key = (bb, ab)
        self.stats.passes[key] = self.stats.passes.get(key, 0) + 1
        self.stats.decode_steps += steps
        self.stats.draft_accepted += int(accepted.sum())
        if not self.use_graphs:
            self.stats.eager_passes += 1
        return PassResult(toks, frames, ab, bb, accepted, steps, voiced)

    @torch.inference_mode()
    def align_rows(self, rows: list[int], draft_frames: Sequence[Sequence[int]] | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Word times for some rows of the last pass (run with `word_times=False`): token start
        frames `[len(rows), K + 1]` and voiced masks `[len(rows), T]`, as that pass would have given.

        The rows move to the front of the static buffers (tokens, audio lengths and the cross K/V of
        the layers the alignment heads read; the pass is over, nothing else reads them), so the
        alignment runs on the smallest batch bucket that holds them. `draft_frames[i]` belongs to
        `rows[i]`."""
        if not self.word_times:
            raise AudioInputError("this runner was built with word_times=False")
        lengths, ab, toks, accepted = self._last
        if not rows or len(set(rows)) != len(rows) or not all(0 <= r < len(lengths) for r in rows):
            raise AudioInputError(f"rows {rows} must be distinct rows of the last pass (0..{len(lengths) - 1})")
        m = len(rows)
        bb = self.batch_bucket(m)
        idx = torch.tensor(rows, device=self.device)
        # rows spread over the pass's own bucket: align that bucket in place (moving them costs a
        # gather of the alignment layers' cross K|V and buys no smaller graph)
        in_place = rows != list(range(m)) and bb == self.batch_bucket(len(lengths))
        if rows != list(range(m)) and not in_place:
            last = max(layer for layer, _ in self.model.alignment_heads) + 1
            self.out_tok[:m].copy_(self.out_tok.index_select(0, idx))
            self.valid_frames[:m].copy_(self.valid_frames.index_select(0, idx))
            self.accepted[:m].copy_(self.accepted.index_select(0, idx))
            # for one audio bucket, stream row r of the cross K|V sits at the same place in every
            # batch bucket's view (DecoderCache.rows): gather the rows (into a temporary), write them first
            t = int(round(ab * SAMPLE_RATE)) // SAMPLES_PER_POSITION
            x = self.cache.rows(len(lengths), t).xkv
            x[:m, :, :last].copy_(x[:, :, :last].index_select(0, idx))
        at = idx if in_place else torch.arange(m, device=self.device)  # where the rows sit now
        if self.device_times:
            tab = np.zeros((m, self.pass_in.table.shape[1]), np.int64)
            if draft_frames is not None:
                self.pass_in.put_draft_frames(tab, range(m), draft_frames)
            dev_tab = torch.as_tensor(tab, device=self.device)
            self.n_draft_frames.index_copy_(0, at, dev_tab[:, 4])
            self.draft_frames.index_copy_(0, at, dev_tab[:, COLS + self.max_draft :])
        self._run("align", bb, ab)
        sel = np.asarray(rows)
        sub = [lengths[r] for r in rows]
        if self.device_times:
            frames = self.frames.index_select(0, at).cpu().numpy()
        else:
            frames = self._token_times(toks[sel], accepted[sel], sub, draft_frames,
                                       self.align.index_select(0, idx) if in_place else None)
        t = int(round(ab * SAMPLE_RATE)) // SAMPLES_PER_POSITION
        db = self.frame_db.index_select(0, idx)[:, :t].cpu().numpy()
        self.stats.align_passes += 1
        self.stats.aligned_rows += m
        return frames, db > (db.max(axis=1, keepdims=True) - self.silence_db)
