"""The LLM engine: continuous batching over a paged KV cache, one `step()` at a time.

Incremental prefill API (used by the vision stage and the scheduler)
--------------------------------------------------------------------
A sequence is a growing context. Open one with `add_request(..., generate=False)`; feed it
while the user is still speaking with `append(seq_id, token_ids=...)` and/or
`append(seq_id, embeddings=tensor[n, hidden], cache_key=...)` (precomputed embeddings, e.g.
vision tokens, occupy n positions; equal `cache_key`s make them prefix-cacheable). Each
`step()` prefills pending positions in chunks of at most `max_prefill_tokens` per step, so
when the turn ends and `start_generation(seq_id, params)` is called only the last few tokens
remain. Generated tokens stay in the context: a later `append` continues the conversation
from where the answer stopped (or was cancelled).

All mutating calls are thread-safe and non-blocking: they enqueue a command that the engine
thread applies at the start of its next step, so `cancel` frees a sequence's blocks within
one step. `step()` returns `StepOutput`s (token ids, text deltas, finish reasons).

Scheduling within the engine: every step runs (1) one decode batch of all sequences that are
generating, then (2) prefill chunks in order of priority (high first), deadline (early
first) and arrival, within the token budget. When KV blocks run out, the lowest-priority
sequence is preempted: its blocks are freed and its context recomputed later (prefix caching
usually makes that cheap). Nothing is dropped silently: `stats` counts preemptions,
cancellations and prefix-cache hits.

KV retention: with a KV budget (`EngineConfig.kv_budget_tokens` or `add_request(...,
kv_budget_tokens=)`), a sequence about to outgrow it has whole blocks evicted between steps
(vision blocks by attention mass first, then text outside a recent window; sinks kept) and
decodes on over the kept blocks; `stats.retention` counts evictions by reason. See
`kv_retention.py` and docs/retention.md.
"""

from __future__ import annotations

import queue
import random
from pathlib import Path
from typing import Any

import torch

from tristream.engine.block_manager import BlockManager
from tristream.engine.engine_blocks import BlockBookkeeping
from tristream.engine.engine_types import (
    Command,
    ContextTooLong,
    EngineConfig,
    EngineStats,
    StepOutput,
    all_greedy,
    to_host,
)
from tristream.engine.kv_cache import KVCache
from tristream.engine.kv_retention import KVRetention
from tristream.engine.models.llama import LlamaModel
from tristream.engine.overlap import OverlapDecode
from tristream.engine.runner import ModelRunner, PrefillChunk
from tristream.engine.sampler import SamplingBatch, apply_logits_masks, greedy_tokens, sample
from tristream.engine.sequence import (
    FinishReason,
    SamplingParams,
    SeqStatus,
    Sequence,
    embedding_keys,
)
from tristream.engine.speculative import SpeculativeDecode
from tristream.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class LLMEngine(BlockBookkeeping):
    """Continuous-batching engine over one model and one paged KV cache."""

    def __init__(self, model: LlamaModel, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = cfg = config or EngineConfig()
        mcfg = model.cfg
        kv_dtype = cfg.kv_dtype or model.dtype
        num_blocks = cfg.num_blocks or max(
            2, cfg.kv_cache_bytes // KVCache.bytes_per_block(mcfg, cfg.block_size, kv_dtype)
        )
        self.cache = KVCache(mcfg, num_blocks, cfg.block_size, kv_dtype, model.device)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_cache)
        self.runner = ModelRunner(model, self.cache, use_graphs=cfg.use_graphs,
                                  graph_buckets=cfg.graph_buckets, max_model_len=cfg.max_model_len,
                                  triton_decode=cfg.triton_decode, decode_kernels=cfg.decode_kernels,
                                  packed_prefill=cfg.packed_prefill)
        self.seqs: dict[int, Sequence] = {}
        self.detok: dict[int, IncrementalDetokenizer] = {}
        self.seeds: dict[int, int] = {}
        self.stats = EngineStats()
        self.retention = KVRetention(model, self.cache, self.blocks, cfg.retention, cfg.kv_budget_tokens,
                                     self.stats.retention)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._arrivals = 0
        self._rng = random.Random()
        self._cancel_outputs: list[StepOutput] = []
        self.timer: Any = None
        """Optional object with `mark(phase)`: called as 'decode', 'prefill', 'sample' and 'post'
        start within `step()` (profiling, e.g. `bench/phases.PhaseTimer`)."""
        eos = set(mcfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_ids = eos
        if cfg.overlap is None:
            cfg.overlap = self.model.device.type == "cuda"
        self.overlap: OverlapDecode | None = OverlapDecode(self) if cfg.overlap else None
        self.spec: SpeculativeDecode | None = None
        if cfg.speculative is not None:
            self.spec = SpeculativeDecode(self, cfg.speculative)

    @classmethod
    def from_path(cls, path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
                  config: EngineConfig | None = None, int8: bool = False, quant: str | None = None
                  ) -> LLMEngine:
        """Load a Hugging Face folder or GGUF file with its tokenizer.

        quant: None, 'int8' or 'int4' weight-only quantisation (CPU); int8=True means 'int8'.
        """
        from tristream.engine.loader import load_hf_folder, resolve_folder

        cfg = config or EngineConfig()
        dt = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        folder = resolve_folder(path)
        model = load_hf_folder(folder, dtype=dt, device=device, max_positions=cfg.max_model_len)
        quant = quant or ("int8" if int8 else None)
        if quant:
            from tristream.engine.quantize import quantize_model_cached

            quantize_model_cached(model, quant, folder)
        try:
            tok: Tokenizer | None = Tokenizer.from_path(folder)
        except FileNotFoundError:
            tok = None
        eng = cls(model, tok, cfg)
        eng.runner.capture()
        return eng

    # ---- commands (thread-safe; applied at the start of the next step) ----

    def add_request(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None,
                    priority: int = 0, deadline: float | None = None, generate: bool = True,
                    chat: list[dict[str, str]] | None = None, kv_budget_tokens: int | None = None) -> int:
        """Create a sequence; returns its id. generate=False opens a context for incremental prefill.

        kv_budget_tokens: this sequence's KV budget (default: the engine's); past it, blocks are
        evicted by the retention policy (`kv_retention.py`) instead of growing the cache."""
        if kv_budget_tokens is not None:
            self.config.retention.check_budget(kv_budget_tokens, self.blocks.block_size)
        keys = self._encode(prompt, chat)
        if len(keys) >= self.config.max_model_len:
            raise ContextTooLong(f"prompt has {len(keys)} tokens; max_model_len is {self.config.max_model_len}")
        if generate and not keys:
            raise ValueError("a generating request needs a non-empty prompt")
        seq = Sequence(keys=keys, params=params or SamplingParams(), priority=priority, deadline=deadline,
                       generating=generate, kv_budget_tokens=kv_budget_tokens)
        self._commands.put((lambda: self._insert(seq), None))
        return seq.seq_id

    def append(self, seq_id: int, token_ids: list[int] | None = None, text: str | None = None,
               embeddings: torch.Tensor | None = None, cache_key: str | None = None) -> None:
        """Append tokens, text and/or precomputed embeddings [n, hidden] to a sequence's context."""
        keys = list(token_ids or [])
        if text:
            keys += self._encode(text, None)
        if embeddings is not None and embeddings.shape[-1] != self.model.cfg.hidden_size:
            raise ValueError(
                f"embeddings have width {embeddings.shape[-1]}; the model's hidden size is "
                f"{self.model.cfg.hidden_size}"
            )
        self._commands.put((lambda: self._append(seq_id, keys, embeddings, cache_key), None))

    def start_generation(self, seq_id: int, params: SamplingParams | None = None) -> None:
        """End of the user's turn: start decoding from the sequence's current context."""
        self._commands.put((lambda: self._start(seq_id, params), None))

    def cancel(self, seq_id: int) -> None:
        """Stop a sequence and free its KV blocks at the next step (barge-in)."""
        self._commands.put((lambda: self._cancel(seq_id), seq_id))

    def close(self, seq_id: int) -> None:
        """Forget an open (non-generating) context and free its blocks."""
        self.cancel(seq_id)

    # ---- command bodies (engine thread) ----

    def _encode(self, prompt: str | list[int] | None, chat: list[dict[str, str]] | None) -> list[int]:
        if chat is not None:
            if self.tokenizer is None:
                raise ValueError("chat messages need a tokenizer; this model has none")
            return self.tokenizer.apply_chat_template(chat)
        if prompt is None:
            return []
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _insert(self, seq: Sequence) -> None:
        self._arrivals += 1
        seq.arrival = self._arrivals
        self.seqs[seq.seq_id] = seq
        self.seeds[seq.seq_id] = seq.params.seed if seq.params.seed is not None else self._rng.getrandbits(62)
        if self.tokenizer is not None:
            self.detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer)

    def _append(self, seq_id: int, keys: list[int], emb: torch.Tensor | None, cache_key: str | None) -> None:
        seq = self.seqs.get(seq_id)
        if seq is None:
            self.stats.ignore("append")
            return
        if len(seq.keys) + len(keys) + (0 if emb is None else int(emb.shape[0])) > self.config.max_model_len:
            # positions past max_model_len have no RoPE row; a KV budget bounds the cache, not this
            self.stats.context_full += 1
            self._finish(seq, FinishReason.LENGTH)
            self._cancel_outputs.append(StepOutput(seq_id, None, "", True, FinishReason.LENGTH))
            return
        seq.keys.extend(keys)
        if emb is not None:
            seq.embeds.append((len(seq.keys), emb.detach()))
            seq.keys.extend(embedding_keys(int(emb.shape[0]), cache_key))

    def _start(self, seq_id: int, params: SamplingParams | None) -> None:
        seq = self.seqs.get(seq_id)
        if seq is None or seq.generating:
            self.stats.ignore("start_generation")
            return
        if params is not None:
            seq.params = params
            if params.seed is not None:
                self.seeds[seq_id] = params.seed
        seq.output_ids = []
        seq.generating = True
        if seq.num_pending == 0 and seq.num_computed > 0:
            seq.num_computed -= 1  # recompute the last position to get its logits
            # after eviction its K/V change: never rewrite a block another sequence shares
            if seq.cache_offset and not self.retention.own_block_of(seq, seq.num_computed):
                self._preempt(seq)

    def _cancel(self, seq_id: int) -> None:
        seq = self.seqs.get(seq_id)
        if seq is None:
            self.stats.ignore("cancel")
            return
        self.stats.cancelled += 1
        self._finish(seq, FinishReason.CANCELLED)
        self._cancel_outputs.append(StepOutput(seq_id, None, "", True, FinishReason.CANCELLED))

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.block_table:
            self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)
        self.detok.pop(seq.seq_id, None)
        self.seeds.pop(seq.seq_id, None)
        self.retention.forget(seq.seq_id)
        if reason is not FinishReason.CANCELLED:
            self.stats.finished += 1

    def _drain(self) -> None:
        for cmd, _ in self._take_commands():
            cmd()

    def _take_commands(self) -> list[Command]:
        """Every queued command, in order (not yet applied)."""
        out: list[Command] = []
        while True:
            try:
                out.append(self._commands.get_nowait())
            except queue.Empty:
                return out

    # ---- the step ----

    def set_overlap(self, on: bool) -> None:
        """Turn overlapped decode (`EngineConfig.overlap`) on or off between steps."""
        if self.overlap is not None and self.overlap.in_flight:
            raise RuntimeError("a decode step is in flight: call step() until has_work() is False, then switch")
        if on and self.spec is not None:
            raise ValueError("overlapped decode and speculative decoding do not run together (speculative.py)")
        self.config.overlap = on
        self.overlap = OverlapDecode(self) if on else None

    def has_work(self) -> bool:
        """Whether a `step()` call would do anything (pending positions, commands, a step in flight)."""
        return (any(s.num_pending > 0 for s in self.seqs.values()) or not self._commands.empty()
                or (self.overlap is not None and self.overlap.in_flight))

    def step(self, allow: set[int] | None = None, max_batch: int | None = None,
             max_prefill_tokens: int | None = None) -> list[StepOutput]:
        """Run one engine step: apply commands, one decode batch, prefill chunks, sample.

        An external scheduler may restrict the step to the sequence ids in `allow` and override
        the decode batch size and the prefill token budget for this step only. With
        `EngineConfig.overlap`, steady greedy decode runs one step ahead (`overlap.py`): each call
        still returns one step's outputs, with the same tokens.
        """
        if self.overlap is not None:
            return self.overlap.step(allow, max_batch, max_prefill_tokens)
        outputs = self._apply_commands()
        decode, chunks = self._schedule(allow, max_batch, max_prefill_tokens)
        if decode or chunks:
            outputs += self._run(decode, chunks)
        return outputs

    def _apply_commands(self) -> list[StepOutput]:
        """Drain the command queue; the outputs of sequences it ended (cancel, context full)."""
        self._cancel_outputs = []
        self._drain()
        return list(self._cancel_outputs)

    def _schedule(self, allow: set[int] | None, max_batch: int | None, max_prefill_tokens: int | None
                  ) -> tuple[list[Sequence], list[PrefillChunk]]:
        """This step's decode batch and prefill chunks (blocks allocated, preempting if needed)."""
        cfg = self.config
        batch_cap = cfg.max_batch if max_batch is None else max_batch
        order = sorted((s for s in self.seqs.values() if allow is None or s.seq_id in allow), key=Sequence.sort_key)
        scheduled: set[int] = set()
        decode: list[Sequence] = []
        for s in order:
            if s.is_decode and len(decode) < batch_cap:
                self.retention.fit(s, 1)
                if self._ensure_blocks(s, len(s.keys), scheduled):
                    decode.append(s)
                    scheduled.add(s.seq_id)
        decode = [s for s in decode if s.status is SeqStatus.RUNNING]  # a later one may have preempted
        chunks: list[PrefillChunk] = []
        budget = cfg.max_prefill_tokens if max_prefill_tokens is None else max_prefill_tokens
        for s in order:
            if budget <= 0:
                break
            if s.seq_id in scheduled or s.num_pending <= 0 or s.status is SeqStatus.FINISHED:
                continue
            if s.status is SeqStatus.WAITING:
                self._admit(s)
            n = self.retention.fit(s, min(s.num_pending, budget))
            if not self._ensure_blocks(s, s.num_computed + n, scheduled):
                n = min(n, len(s.block_table) * self.blocks.block_size - s.cache_len)
                if n <= 0:
                    continue
            start = s.num_computed
            chunks.append(PrefillChunk(s, start, n, want_logits=s.generating and start + n == len(s.keys)))
            scheduled.add(s.seq_id)
            budget -= n
        decode = [s for s in decode if s.status is SeqStatus.RUNNING]
        chunks = [c for c in chunks if c.seq.status is SeqStatus.RUNNING]
        return decode, chunks

    def _run(self, decode: list[Sequence], chunks: list[PrefillChunk]) -> list[StepOutput]:
        """Compute a scheduled step, sample, and account for it (synchronous)."""
        self.stats.steps += 1
        tm = self.timer
        sampled_seqs: list[Sequence] = []
        logit_parts: list[torch.Tensor] = []
        spec_out: list[StepOutput] = []
        if decode and self.spec is not None:  # drafts verified in one forward; the rest decodes as usual
            if tm is not None:
                tm.mark("decode")
            spec_out, decode = self.spec.run(decode)
        if decode:
            if tm is not None:
                tm.mark("decode")
            if not chunks and all_greedy(decode):  # a decode graph's own argmax, read from host memory
                toks = self.runner.decode_greedy_host(decode)
                if toks is not None:
                    if tm is not None:
                        tm.mark("post")
                    return spec_out + self._account(decode, [], decode, toks)
            logit_parts.append(self.runner.decode(decode))
            sampled_seqs += decode
        if chunks:
            if tm is not None:
                tm.mark("prefill")
            lg = self.runner.prefill(chunks)
            if lg is not None:
                logit_parts.append(lg)
                sampled_seqs += [c.seq for c in chunks if c.want_logits]
        if tm is not None:
            tm.mark("sample")
        token_list: list[int] = []
        if sampled_seqs:
            logits = logit_parts[0] if len(logit_parts) == 1 else torch.cat(logit_parts)
            if all_greedy(sampled_seqs):
                token_list = to_host(greedy_tokens(logits))  # greedy fast path: no parameter tensors
            else:
                token_list = self._sample(logits, sampled_seqs)
        if tm is not None:
            tm.mark("post")
        return spec_out + self._account(decode, chunks, sampled_seqs, token_list)

    def _account(self, decode: list[Sequence], chunks: list[PrefillChunk], sampled_seqs: list[Sequence],
                 token_list: list[int]) -> list[StepOutput]:
        """Advance computed positions, publish full blocks, accept sampled tokens."""
        for s in decode:
            s.num_computed += 1
            self.stats.decode_tokens += 1
        for c in chunks:
            c.seq.num_computed += c.length
            self.stats.prefill_tokens += c.length
        for s in decode:
            self._publish(s)
        for c in chunks:
            self._publish(c.seq)
        return [self._accept(s, int(tok)) for s, tok in zip(sampled_seqs, token_list, strict=True)]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        batch = SamplingBatch.build(
            [s.params for s in seqs], [len(s.output_ids) for s in seqs], [self.seeds[s.seq_id] for s in seqs],
            [[k for k in s.keys if k >= 0] for s in seqs]
            if any(s.params.repetition_penalty != 1.0 for s in seqs) else None,
            logits.device,
        )
        masks = [(i, m) for i, s in enumerate(seqs) if s.params.logits_mask is not None
                 and (m := s.params.logits_mask(s.output_ids)) is not None]
        if masks:
            logits = apply_logits_masks(logits, masks)
        return to_host(sample(logits, batch))  # the one device→host copy of the step

    def _accept(self, seq: Sequence, tok: int) -> StepOutput:
        p = seq.params
        if not p.ignore_eos and (tok in self.eos_ids or tok in p.stop_token_ids):
            self._finish(seq, FinishReason.EOS if tok in self.eos_ids else FinishReason.STOP)
            return StepOutput(seq.seq_id, tok, "", True, seq.finish_reason)
        seq.output_ids.append(tok)
        seq.keys.append(tok)
        text = ""
        det = self.detok.get(seq.seq_id)
        reason: FinishReason | None = None
        if det is not None:
            text = det.push(tok)
            if p.stop and text:
                full = det.text
                window = len(text) + max(len(x) for x in p.stop)
                tail_start = max(0, len(full) - window)
                hits = [i for i in (full.find(x, tail_start) for x in p.stop) if i >= 0]
                if hits:
                    cut = min(hits)
                    text = text[: max(0, len(text) - (len(full) - cut))]
                    reason = FinishReason.STOP
        if reason is None and (len(seq.output_ids) >= p.max_tokens or len(seq.keys) >= self.config.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason)
            return StepOutput(seq.seq_id, tok, text, True, reason)
        return StepOutput(seq.seq_id, tok, text, False)

    # ---- convenience ----

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[list[int]]:
        """Run prompts to completion (blocking); returns generated token ids per prompt."""
        ids = [self.add_request(p, params) for p in prompts]
        out: dict[int, list[int]] = {i: [] for i in ids}
        done: set[int] = set()
        while len(done) < len(ids):
            for o in self.step():
                if o.seq_id in out:
                    if o.token_id is not None and not (o.finished and o.finish_reason is FinishReason.EOS):
                        out[o.seq_id].append(o.token_id)
                    if o.finished:
                        done.add(o.seq_id)
        return [out[i] for i in ids]
