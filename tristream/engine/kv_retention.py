"""KV retention in the engine: keep a sequence's cache within its token budget between steps.

When a sequence's next work (one decode position, or a prefill chunk) would make it hold more
than `budget // block_size` blocks, whole, full, computed blocks leave its block table: the
`ModalityAwareRetention` policy picks them (vision-token blocks first by attention mass, then
text outside a recent window, never the sink tokens nor the newest block), their references go
back to the block manager, and the sequence's `cache_offset` grows by one block per block
evicted, so later positions keep their logical RoPE positions while their K/V are written at
compacted cache indexes (see `sequence.py`). Prefill chunks are shortened to what fits.

Attention mass comes from `retention_probe.attention_probe`, run only when an eviction has
vision blocks to choose among; it is folded into a per-sequence exponentially decayed
`AttentionMass`.

Rules that keep the cache correct:
- a sequence with evictions publishes no further blocks to the prefix cache (their K/V were
  computed over a gapped context, so their hashes would no longer describe a plain prefix);
  blocks it published before keep their (valid) content and their other references;
- preemption keeps the evictions: only the kept positions are recomputed (prefix-cache hits
  first for the plain prefix before the first evicted block), at their logical positions, each
  seeing the kept positions before it. Their K/V then equal a run in which every evicted
  position was masked from the start; the evicted ones had shaped the original K/V, which no
  recompute of the kept part alone can reproduce.
- a shared block is copied before an evicted sequence rewrites a position in it;
- the embeddings of evicted positions are freed (only kept positions are ever recomputed).
"""

from __future__ import annotations

import bisect
import dataclasses
import time

import torch

from tristream.engine.block_manager import BlockManager, OutOfBlocks
from tristream.engine.kv_cache import KVCache
from tristream.engine.models.llama import LlamaModel
from tristream.engine.retention_probe import attention_probe
from tristream.engine.sequence import Sequence
from tristream.vision.retention import (
    VISION,
    AttentionMass,
    KVBlockInfo,
    ModalityAwareRetention,
    modality_of_keys,
)


class KVBudgetError(ValueError):
    """A KV budget too small for the retention policy's protected blocks."""


@dataclasses.dataclass(slots=True)
class RetentionConfig:
    """Knobs of the retention policy (used only for sequences with a KV budget)."""

    sink_tokens: int = 4  # first positions never evicted (attention sinks)
    text_window_tokens: int = 256  # most recent text kept
    probe_layers: int | None = None  # layers (the last ones) averaged by the attention probe; None: all
    mass_decay: float = 0.9  # decay of a sequence's attention mass from one probe to the next

    def min_budget_tokens(self, block_size: int) -> int:
        """The smallest budget that always leaves room to grow: sink blocks + window blocks + the
        newest (partial) block + one block to write into."""
        blocks = -(-self.sink_tokens // block_size) + -(-self.text_window_tokens // block_size) + 2
        return blocks * block_size

    def check_budget(self, budget_tokens: int, block_size: int) -> None:
        """Raise KVBudgetError when `budget_tokens` cannot hold the protected blocks."""
        if self.sink_tokens < 0 or self.text_window_tokens < 0:
            raise KVBudgetError(f"sink_tokens ({self.sink_tokens}) and text_window_tokens "
                                f"({self.text_window_tokens}) must be ≥ 0")
        need = self.min_budget_tokens(block_size)
        if budget_tokens < need:
            raise KVBudgetError(
                f"kv_budget_tokens={budget_tokens} is too small: with block_size={block_size}, "
                f"sink_tokens={self.sink_tokens} and text_window_tokens={self.text_window_tokens} it must be "
                f"≥ {need} (sink blocks + window blocks + 2); raise the budget or shrink the window")


@dataclasses.dataclass(slots=True)
class RetentionStats:
    """Eviction counters (engine stats)."""

    evicted_blocks: dict[str, int] = dataclasses.field(default_factory=dict)  # by policy reason
    evictions: int = 0  # eviction events (one per sequence and step that evicted)
    probes: int = 0  # attention-mass probes run
    probe_seconds: float = 0.0  # wall time spent in probes
    over_budget: int = 0  # steps a sequence ran past its budget because nothing was evictable
    copied_blocks: int = 0  # shared blocks copied before an evicted sequence rewrote a position
    dropped_embedding_rows: int = 0  # embedding rows (vision tokens) freed with their evicted blocks


class KVRetention:
    """Fits sequences into their KV budgets by evicting blocks between steps."""

    def __init__(self, model: LlamaModel, cache: KVCache, blocks: BlockManager, config: RetentionConfig,
                 default_budget: int | None, stats: RetentionStats) -> None:
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.config = config
        self.default_budget = default_budget
        self.stats = stats
        self.policy = ModalityAwareRetention(sink_tokens=config.sink_tokens,
                                             text_window_tokens=config.text_window_tokens)
        self.masses: dict[int, AttentionMass] = {}
        if default_budget is not None:
            config.check_budget(default_budget, blocks.block_size)

    def budget_blocks(self, seq: Sequence) -> int | None:
        """The sequence's budget in blocks (its own, else the engine's default); None: no budget."""
        budget = seq.kv_budget_tokens if seq.kv_budget_tokens is not None else self.default_budget
        return None if budget is None else budget // self.blocks.block_size

    def fit(self, seq: Sequence, n_new: int) -> int:
        """Make room for `n_new` more positions of `seq` within its budget; returns how many fit
        (`n_new`, or fewer for a prefill chunk; at least 1)."""
        bb = self.budget_blocks(seq)
        if bb is None or n_new <= 0:
            return n_new
        bs = self.blocks.block_size
        cfg = self.config
        cache_len = seq.cache_len
        if -(-(cache_len + n_new) // bs) <= bb:
            return n_new
        # a chunk never needs more than what eviction can always free: the rest waits a step
        protected = -(-cfg.sink_tokens // bs) + -(-cfg.text_window_tokens // bs) + 1
        n_new = min(n_new, max(bs, (bb - protected) * bs))
        want = -(-(cache_len + n_new) // bs)
        computed = -(-cache_len // bs)
        self._evict(seq, computed - max(0, want - bb))
        room = bb * bs - seq.cache_len
        if room <= 0:
            self.stats.over_budget += 1
            return min(n_new, bs)
        return min(n_new, room)

    def _evict(self, seq: Sequence, keep_blocks: int) -> None:
        """Evict computed blocks of `seq` so that at most `keep_blocks` computed blocks remain."""
        bs = self.blocks.block_size
        cache_len = seq.cache_len
        computed = -(-cache_len // bs)
        if computed <= keep_blocks:
            return
        logical = seq.logical_blocks()
        infos: list[KVBlockInfo] = []
        for j in range(computed):
            first = logical[j] * bs
            n = min(bs, cache_len - j * bs)
            infos.append(KVBlockInfo(seq.block_table[j], first, n, modality_of_keys(seq.keys[first:first + n])))
        if any(b.modality == VISION and b.first_pos >= self.config.sink_tokens for b in infos[:-1]):
            self._observe(seq, infos)
        plan = self.policy.plan(infos, max(0, keep_blocks))
        if not plan.evict:
            return
        gone = set(plan.evict)
        for j, b in enumerate(infos):
            if b.block_id in gone:
                bisect.insort(seq.evicted_blocks, logical[j])
        seq.block_table = [b for b in seq.block_table if b not in gone]
        seq.cache_offset += bs * len(gone)
        self.blocks.release(list(plan.evict))
        if seq.embeds:
            self._drop_embeddings(seq)
        mass = self.masses.get(seq.seq_id)
        if mass is not None:
            mass.forget(list(plan.evict))
        self.stats.evictions += 1
        for reason, k in plan.reasons.items():
            self.stats.evicted_blocks[reason] = self.stats.evicted_blocks.get(reason, 0) + k

    def _drop_embeddings(self, seq: Sequence) -> None:
        """Free the embeddings of evicted positions: never needed again, since a preempted
        sequence recomputes only its kept positions. A partly evicted segment keeps copies of
        its kept runs (a slice would pin the whole tensor)."""
        bs = self.blocks.block_size
        gone = set(seq.evicted_blocks)
        out: list[tuple[int, torch.Tensor]] = []
        for start, emb in seq.embeds:
            n = int(emb.shape[0])
            b0, b1 = start // bs, (start + n - 1) // bs
            if not any(b in gone for b in range(b0, b1 + 1)):
                out.append((start, emb))
                continue
            run: int | None = None
            for b in range(b0, b1 + 2):
                keep = b <= b1 and b not in gone
                if keep and run is None:
                    run = max(start, b * bs)
                elif not keep and run is not None:
                    end = min(start + n, b * bs)
                    out.append((run, emb[run - start:end - start].clone()))
                    run = None
            self.stats.dropped_embedding_rows += n - sum(
                int(e.shape[0]) for st, e in out if start <= st < start + n)
        seq.embeds = out

    def _observe(self, seq: Sequence, infos: list[KVBlockInfo]) -> None:
        """Probe the attention of the sequence's last position and fold it into its mass."""
        import numpy as np

        t0 = time.perf_counter()
        probs = attention_probe(self.model, self.cache, seq, self.config.probe_layers)
        self.stats.probes += 1
        self.stats.probe_seconds += time.perf_counter() - t0
        bs = self.blocks.block_size
        block_of = np.asarray(seq.block_table[:len(infos)], dtype=np.int64).repeat(bs)[:seq.cache_len]
        mass = self.masses.get(seq.seq_id)
        if mass is None:
            mass = self.masses[seq.seq_id] = AttentionMass(self.config.mass_decay)
        mass.observe(block_of, probs)
        mass.annotate(infos)

    def own_block_of(self, seq: Sequence, position: int) -> bool:
        """Copy-on-write: make the block holding logical `position` private to `seq` before it is
        rewritten (a block another sequence shares keeps its content). False: no free block."""
        bs = self.blocks.block_size
        j = (position - seq.cache_offset) // bs
        if j >= len(seq.block_table):
            return True
        old = seq.block_table[j]
        if self.blocks.blocks[old].ref_count <= 1:
            return True
        try:
            new = self.blocks.allocate()
        except OutOfBlocks:
            return False
        self.cache.k[:, new].copy_(self.cache.k[:, old])
        self.cache.v[:, new].copy_(self.cache.v[:, old])
        seq.block_table[j] = new
        self.blocks.release([old])
        self.stats.copied_blocks += 1
        return True

    def reset(self, seq: Sequence) -> None:
        """Preemption: the blocks (and their attention mass) are gone; the evictions stay, so
        only the kept positions are recomputed, at their logical positions."""
        self.masses.pop(seq.seq_id, None)

    def forget(self, seq_id: int) -> None:
        """Drop per-sequence state (finish / cancel)."""
        self.masses.pop(seq_id, None)
