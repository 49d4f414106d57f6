"""Speculative decoding: n-gram drafts from the sequence's own tokens, verified by the target.

A draft is a guess at the next k tokens. The target model scores the pending token and the k
draft tokens in one forward (k+1 positions, logits at each); the verification rule keeps a
prefix of the draft and adds one token of the target's own, so every verify step yields
between 1 and k+1 tokens for one forward of the target.

Drafter (`propose_ngram`): prompt lookup. The last n tokens of the context (conversation plus
answer so far) are searched for earlier in the same context, longest n first; the tokens that
followed the most recent earlier occurrence are the draft. It costs no model and wins where
answers repeat their context: read-backs, lists, quoted names, code, the model's own loops.

Verification rules:

- greedy (`verify_greedy`): accept the longest draft prefix whose every token equals the
  target's argmax at that position, then the target's argmax after it. The result equals plain
  greedy decoding token for token (up to the numerics of a k+1-row forward against a 1-row one).
- sampling (`verify_sampling`): standard speculative sampling. Draft token x at position i is
  accepted with probability min(1, p_i(x) / q_i(x)); on rejection the token is drawn from
  normalize(max(0, p_i - q_i)) and the step ends; when all k are accepted a last token is drawn
  from p_k. The emitted tokens are distributed exactly as sampling from p one token at a time.
  For a deterministic drafter (n-gram lookup) q_i is one-hot at the draft token: accept with
  probability p_i(x), else draw from p_i with x removed.

`SpeculativeDecode` is the engine's verify step (greedy sequences on the CPU path), turned on
by `EngineConfig.speculative`; docs/engine-decode.md has the design and the measured figures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tristream.engine.engine import LLMEngine
    from tristream.engine.engine_types import StepOutput
    from tristream.engine.sequence import Sequence


@dataclasses.dataclass(slots=True)
class SpeculativeConfig:
    """N-gram drafting and when the engine verifies drafts.

    max_ngram / min_ngram: the suffix lengths searched, longest first; max_draft: tokens per
    draft (k); max_batch: decode batches larger than this run without drafts (a verify step
    costs k+1 rows per sequence, which stops paying once the batch is compute-bound).

    row_cost: what one more verify row costs relative to a decode step (0: drafts are free,
    always draft up to max_draft). Above 0, each sequence keeps a running acceptance rate a
    (`ema` weight on the newest verify step, `prior` before the first) and drafts the k that
    maximises expected tokens per cost, (1 + a + ... + a^k) / (1 + row_cost k) (`draft_len`);
    where no k > 0 pays it decodes plainly and drafts one token every `probe_every` steps to
    update a."""

    max_ngram: int = 3
    min_ngram: int = 1
    max_draft: int = 4
    max_batch: int = 4
    row_cost: float = 0.0
    ema: float = 0.3
    prior: float = 0.5
    probe_every: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram or self.max_draft < 1 or self.max_batch < 1:
            raise ValueError(
                f"bad speculative config: min_ngram={self.min_ngram}, max_ngram={self.max_ngram} "
                f"(1 <= min <= max), max_draft={self.max_draft} (>= 1), max_batch={self.max_batch} (>= 1)"
            )
        if self.row_cost < 0 or not 0 < self.ema <= 1 or not 0 <= self.prior <= 1 or self.probe_every < 1:
            raise ValueError(
                f"bad speculative config: row_cost={self.row_cost} (>= 0), ema={self.ema} (0, 1], "
                f"prior={self.prior} [0, 1], probe_every={self.probe_every} (>= 1)"
            )


def draft_len(accept: float, row_cost: float, max_draft: int) -> int:
    """The draft length k in 0..max_draft with the most expected tokens per target cost, for a
    per-token acceptance probability `accept` and a verify of k+1 rows costing 1 + row_cost k
    decode steps: argmax (1 + a + ... + a^k) / (1 + row_cost k); 0 when no draft pays."""
    best_k, best, tokens, term = 0, 1.0, 1.0, 1.0
    for k in range(1, max_draft + 1):
        term *= accept
        tokens += term
        value = tokens / (1.0 + row_cost * k)
        if value > best + 1e-12:
            best_k, best = k, value
    return best_k


def propose_ngram(tokens: Seq[int] | np.ndarray, max_ngram: int = 3, min_ngram: int = 1,
                  max_draft: int = 4) -> list[int]:
    """Draft up to `max_draft` tokens by prompt lookup over `tokens` (the whole context so far).

    For n from `max_ngram` down to `min_ngram`: find the most recent earlier occurrence of the
    last n tokens (an occurrence that has at least one token after it) and return the tokens
    that followed it. Negative keys (embedding positions) never match and end a draft.
    Returns [] when no suffix recurs."""
    arr = np.asarray(tokens, dtype=np.int64)
    n_tok = int(arr.shape[0])
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = arr[n_tok - n:]
        if (suffix < 0).any():
            continue
        # windows arr[i:i+n] for i + n <= n_tok - 1: each has a continuation token arr[i+n]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size == 0:
            continue
        start = int(hits[-1]) + n
        draft = arr[start:start + max_draft]
        neg = np.flatnonzero(draft < 0)
        if neg.size:
            draft = draft[:int(neg[0])]
        if draft.size:
            return [int(t) for t in draft]
    return []


def verify_greedy(draft: Seq[int], target: Seq[int] | torch.Tensor) -> list[int]:
    """Tokens a greedy verify step emits.

    target: the target's argmax at each of the k+1 scored positions (position i predicts the
    token after the context plus draft[:i]); len(target) == len(draft) + 1. Returns
    draft[:m] + [target[m]] for the longest m with draft[:m] == target[:m]."""
    tgt = target.tolist() if isinstance(target, torch.Tensor) else list(target)
    if len(tgt) != len(draft) + 1:
        raise ValueError(f"target has {len(tgt)} positions; a draft of {len(draft)} needs {len(draft) + 1}")
    m = 0
    while m < len(draft) and int(draft[m]) == int(tgt[m]):
        m += 1
    return [int(t) for t in draft[:m]] + [int(tgt[m])]


def verify_sampling(draft: Seq[int], p: torch.Tensor, q: torch.Tensor | None = None,
                    generator: torch.Generator | None = None) -> list[int]:
    """Tokens a sampling verify step emits (speculative sampling; distribution-preserving).

    draft: k draft tokens; p: the target's probabilities [k+1, vocab] at the scored positions
    (row i conditioned on the context plus draft[:i]); q: the drafter's probabilities [k, vocab]
    that the draft tokens were drawn from, or None for a deterministic drafter (q_i one-hot at
    draft[i]). Returns 1..k+1 tokens: the accepted draft prefix and one token drawn from the
    residual distribution (on a rejection) or from p_k (when every draft token is accepted)."""
    k = len(draft)
    if p.dim() != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p has shape {tuple(p.shape)}; a draft of {k} needs [{k + 1}, vocab]")
    if q is not None and tuple(q.shape) != (k, p.shape[1]):
        raise ValueError(f"q has shape {tuple(q.shape)}; expected ({k}, {p.shape[1]})")
    p = p.double()
    out: list[int] = []
    for i, x in enumerate(int(t) for t in draft):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if qx > 0 and u < min(1.0, px / qx):
            out.append(x)
            continue
        if q is None:
            resid = p[i].clone()
            resid[x] = 0.0
        else:
            resid = (p[i] - q[i].double()).clamp_(min=0.0)
        total = float(resid.sum())
        if total <= 0.0:  # p == q here: a rejection had probability 0; fall back to p itself
            resid, total = p[i], float(p[i].sum())
        out.append(int(torch.multinomial(resid / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k] / p[k].sum(), 1, generator=generator)))
    return out


@dataclasses.dataclass(slots=True)
class SpecStats:
    """What the engine's verify steps did (`EngineStats.spec`)."""

    verify_steps: int = 0  # forwards of the target that scored drafts
    verified_seqs: int = 0  # sequence rows of those forwards
    draft_tokens: int = 0  # draft tokens scored
    accepted_tokens: int = 0  # draft tokens accepted
    emitted_tokens: int = 0  # tokens produced by verify steps (accepted + one per row)


class SpeculativeDecode:
    """The engine's verify step for greedy decoding sequences (engine thread only).

    For each eligible decode sequence (greedy, no logits mask, no KV budget or eviction) it
    drafts with `propose_ngram`, extends the block table for the draft without preempting
    anyone, scores the pending token plus the draft in one forward of the target (all rows of
    every sequence in one packed prefill-style forward, `ModelRunner.verify`), keeps what
    `verify_greedy` accepts, and frees blocks reserved for rejected positions. Their K/V slots
    lie past `num_computed`, so a later step overwrites them; only computed blocks are
    published. Each emitted token goes through the engine's `_accept` (EOS, stop strings,
    max_tokens, context length), so one step can return several outputs for one sequence."""

    def __init__(self, engine: LLMEngine, config: SpeculativeConfig) -> None:
        if engine.model.device.type != "cpu":
            raise ValueError("speculative decoding runs on the CPU path only (not yet in CUDA graphs)")
        if engine.config.overlap:
            raise ValueError("speculative decoding needs overlapped decode off (EngineConfig.overlap=False)")
        self.eng = engine
        self.config = config
        self.stats: SpecStats = engine.stats.spec
        self._accept_rate: dict[int, float] = {}  # per sequence (row_cost > 0)
        self._idle: dict[int, int] = {}  # decode steps since the last draft, while none pays

    def eligible(self, seq: Sequence) -> bool:
        p = seq.params
        return (p.temperature == 0 and p.repetition_penalty == 1.0 and p.logits_mask is None
                and seq.cache_offset == 0 and seq.kv_budget_tokens is None
                and self.eng.config.kv_budget_tokens is None)

    def draft(self, seq: Sequence) -> list[int]:
        """This step's draft for `seq`, capped by max_tokens and the model length."""
        c = self.config
        room = min(c.max_draft, seq.params.max_tokens - len(seq.output_ids) - 1,
                   self.eng.config.max_model_len - len(seq.keys))
        if room <= 0:
            return []
        if c.row_cost > 0:
            k = draft_len(self._accept_rate.get(seq.seq_id, c.prior), c.row_cost, room)
            if k == 0:
                idle = self._idle.get(seq.seq_id, 0) + 1
                if idle < c.probe_every:
                    self._idle[seq.seq_id] = idle
                    return []
                k = 1
            self._idle[seq.seq_id] = 0
            room = k
        return propose_ngram(seq.keys, c.max_ngram, c.min_ngram, room)

    def _learn(self, seq: Sequence, drafted: int, accepted: int) -> None:
        c = self.config
        if c.row_cost > 0 and drafted:
            a = self._accept_rate.get(seq.seq_id, c.prior)
            self._accept_rate[seq.seq_id] = (1 - c.ema) * a + c.ema * accepted / drafted

    def _reserve(self, seq: Sequence, k: int) -> int:
        """Blocks for the draft's k positions, without preempting; returns how many fit."""
        from tristream.engine.block_manager import OutOfBlocks

        eng = self.eng
        bs = eng.blocks.block_size
        need = -(-(len(seq.keys) + k) // bs) - len(seq.block_table)
        try:
            for _ in range(need):
                seq.block_table.append(eng.blocks.allocate())
        except OutOfBlocks:
            pass
        return max(0, min(k, len(seq.block_table) * bs - len(seq.keys)))

    def run(self, decode: list[Sequence]) -> tuple[list[StepOutput], list[Sequence]]:
        """Verify drafts for the eligible sequences of this step's decode batch.

        Returns the verified sequences' outputs and the decode sequences left for the plain
        decode step (all of them, having run nothing, when no sequence has a draft)."""
        if len(decode) > self.config.max_batch:
            return [], decode
        if len(self._accept_rate) + len(self._idle) > 2 * len(self.eng.seqs) + 16:  # forget finished ones
            for state in (self._accept_rate, self._idle):
                for sid in [i for i in state if i not in self.eng.seqs]:
                    del state[sid]
        cand = [s for s in decode if self.eligible(s)]
        drafts = {s.seq_id: self.draft(s) for s in cand}
        if not any(drafts.values()):
            return [], decode
        from tristream.engine.runner import PrefillChunk

        eng = self.eng
        chunks: list[PrefillChunk] = []
        lens: dict[int, int] = {}
        for s in cand:
            d = drafts[s.seq_id]
            d = d[:self._reserve(s, len(d))]
            drafts[s.seq_id] = d
            lens[s.seq_id] = len(s.keys)
            s.keys.extend(d)
            chunks.append(PrefillChunk(s, lens[s.seq_id] - 1, 1 + len(d), True, all_logits=True))
        try:
            logits = eng.runner.verify(chunks)
        finally:
            for s in cand:
                del s.keys[lens[s.seq_id]:]
        target = logits.argmax(dim=-1).tolist()
        st = self.stats
        st.verify_steps += 1
        st.verified_seqs += len(cand)
        outputs: list[StepOutput] = []
        row = 0
        bs = eng.blocks.block_size
        for s in cand:
            d = drafts[s.seq_id]
            toks = verify_greedy(d, target[row:row + len(d) + 1])
            row += len(d) + 1
            m = len(toks) - 1
            st.draft_tokens += len(d)
            st.accepted_tokens += m
            self._learn(s, len(d), m)
            s.keys.extend(toks[:m])  # the accepted draft is context now: publish sees its keys
            s.num_computed += 1 + m
            eng.stats.decode_tokens += 1 + m
            eng._publish(s)
            del s.keys[len(s.keys) - m:]
            for tok in toks:
                out = eng._accept(s, tok)
                outputs.append(out)
                st.emitted_tokens += 1
                if out.finished:
                    break
            if s.block_table:  # still running: give back blocks of rejected positions
                keep = -(-len(s.keys) // bs)
                if len(s.block_table) > keep:
                    eng.blocks.release(s.block_table[keep:])
                    del s.block_table[keep:]
        return outputs, [s for s in decode if s.seq_id not in drafts]
