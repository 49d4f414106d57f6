"""KV block bookkeeping of the engine's sequences: admission with prefix-cache hits, allocation
with preemption by recompute, publishing full blocks to the prefix cache. A base class of
`LLMEngine` (engine.py), kept apart so that the step logic stays readable."""

from __future__ import annotations

from tristream.engine.block_manager import BlockManager, OutOfBlocks
from tristream.engine.engine_types import EngineStats
from tristream.engine.kv_retention import KVRetention
from tristream.engine.sequence import SeqStatus, Sequence


class BlockBookkeeping:
    """Block operations over `self.blocks`, `self.seqs`, `self.retention` and `self.stats`."""

    blocks: BlockManager
    seqs: dict[int, Sequence]
    retention: KVRetention
    stats: EngineStats

    def _admit(self, seq: Sequence) -> None:
        """Take prefix-cache hits for a waiting sequence."""
        bs = self.blocks.block_size
        limit = len(seq.keys) - 1 if seq.generating else len(seq.keys)
        off = seq.cache_offset  # > 0: preempted after eviction; only the part before the first gap is a plain prefix
        blocks, last = self.blocks.match_prefix(seq.keys[:seq.evicted_blocks[0] * bs] if off else seq.keys)
        seq.block_table = blocks
        seq.num_published = len(blocks)
        seq.last_hash = last
        cached = len(blocks) * bs
        seq.num_cached_tokens = min(cached, max(0, limit - off))
        seq.num_computed = off + seq.num_cached_tokens
        self.stats.prefix_cached_tokens += seq.num_cached_tokens
        seq.status = SeqStatus.RUNNING

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.num_published = 0
        seq.num_computed = seq.cache_offset  # only the kept blocks are recomputed (sequence.py)
        seq.last_hash = None
        self.retention.reset(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.stats.preemptions += 1

    def _ensure_blocks(self, seq: Sequence, upto: int, protect: set[int]) -> bool:
        """Hold enough blocks for logical positions [0, upto), preempting lower-priority sequences."""
        bs = self.blocks.block_size
        need = -(-(upto - seq.cache_offset) // bs) - len(seq.block_table)
        while need > 0:
            try:
                seq.block_table.append(self.blocks.allocate())
                need -= 1
            except OutOfBlocks:
                victim = self._victim(seq, protect)
                if victim is None:
                    return False
                self._preempt(victim)
        return True

    def _victim(self, requester: Sequence, protect: set[int]) -> Sequence | None:
        cands = [s for s in self.seqs.values()
                 if s.block_table and s.seq_id not in protect and s.seq_id != requester.seq_id
                 and s.sort_key() > requester.sort_key()]
        return max(cands, key=lambda s: s.sort_key()) if cands else None

    def _publish(self, seq: Sequence) -> None:
        if seq.cache_offset:  # evicted: later blocks were computed over a gapped context
            return
        bs = self.blocks.block_size
        while (seq.num_published + 1) * bs <= seq.num_computed:
            i = seq.num_published
            seq.last_hash = self.blocks.publish(seq.block_table[i], seq.last_hash, tuple(seq.keys[i * bs:(i + 1) * bs]))
            seq.num_published += 1
