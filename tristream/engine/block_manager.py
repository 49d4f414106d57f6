"""KV-cache block allocation with reference counts and prefix caching.

A sequence's context is split into blocks of `block_size` token keys (token ids; opaque
negative keys for precomputed embeddings). Once a block is full and its KV computed, it is
published under a chained hash `hash((previous block's hash, its keys))`; a later sequence
whose prefix hashes to the same value reuses the block after its keys are compared
(collisions never alias). Freed blocks keep their content and stay findable until they are
handed out again, so a finished turn's prefix still hits. Blocks are shared by reference
count; a block returns to the free list when its count reaches zero.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    """No free KV-cache block: the caller must preempt a sequence or wait."""


class BlockAccountingError(RuntimeError):
    """A block was freed twice or its reference count went negative (a bug, never user error)."""


@dataclasses.dataclass(slots=True)
class Block:
    """One KV-cache block's bookkeeping."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    keys: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True)
class BlockStats:
    """Counters for observability."""

    allocated: int = 0
    freed: int = 0
    prefix_hits: int = 0  # blocks reused from the prefix cache
    prefix_queries: int = 0  # full blocks looked up


class BlockManager:
    """Owns the ids of `num_blocks` KV-cache blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in LRU order: blocks without content first, then least recently freed.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.by_hash: dict[int, int] = {}
        self.enable_prefix_cache = enable_prefix_cache
        self.stats = BlockStats()

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @staticmethod
    def chain_hash(prev: int | None, keys: tuple[int, ...]) -> int:
        return hash((prev, keys))

    def _take(self, block_id: int) -> Block:
        b = self.blocks[block_id]
        if b.ref_count == 0:
            self.free.pop(block_id, None)
        b.ref_count += 1
        return b

    def allocate(self) -> int:
        """A fresh block (reference count 1); raises OutOfBlocks when none is free."""
        if not self.free:
            raise OutOfBlocks("no free KV-cache block")
        block_id, _ = self.free.popitem(last=False)
        b = self.blocks[block_id]
        if b.hash is not None and self.by_hash.get(b.hash) == block_id:
            del self.by_hash[b.hash]
        b.hash, b.keys, b.ref_count = None, (), 1
        self.stats.allocated += 1
        return block_id

    def match_prefix(self, keys: list[int]) -> tuple[list[int], int | None]:
        """Take references on the longest cached chain of full blocks that prefixes `keys`.

        Returns the block ids (now referenced by the caller) and the hash of the last one.
        """
        out: list[int] = []
        prev: int | None = None
        if not self.enable_prefix_cache:
            return out, prev
        bs = self.block_size
        for i in range(len(keys) // bs):
            chunk = tuple(keys[i * bs:(i + 1) * bs])
            h = self.chain_hash(prev, chunk)
            self.stats.prefix_queries += 1
            bid = self.by_hash.get(h)
            if bid is None or self.blocks[bid].keys != chunk:
                break
            self._take(bid)
            self.stats.prefix_hits += 1
            out.append(bid)
            prev = h
        return out, prev

    def publish(self, block_id: int, prev_hash: int | None, keys: tuple[int, ...]) -> int:
        """Register a full, computed block under its chain hash; returns the hash."""
        if len(keys) != self.block_size:
            raise ValueError(f"only full blocks ({self.block_size} keys) are published, got {len(keys)}")
        b = self.blocks[block_id]
        h = self.chain_hash(prev_hash, keys)
        b.hash, b.keys = h, keys
        if self.enable_prefix_cache and h not in self.by_hash:
            self.by_hash[h] = block_id
        return h

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block (last block first, so its tail is reused last)."""
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            if b.ref_count <= 0:
                raise BlockAccountingError(f"block {bid} released with reference count {b.ref_count}")
            b.ref_count -= 1
            if b.ref_count == 0:
                if b.hash is None:
                    self.free[bid] = None
                    self.free.move_to_end(bid, last=False)
                else:
                    self.free[bid] = None
                self.stats.freed += 1

    def check(self) -> None:
        """Verify invariants (tests): free list ⇔ zero references, hash table consistent."""
        for b in self.blocks:
            if b.ref_count < 0:
                raise BlockAccountingError(f"block {b.block_id} has negative references")
            if (b.ref_count == 0) != (b.block_id in self.free):
                raise BlockAccountingError(f"block {b.block_id}: refs {b.ref_count} vs free-list membership")
        for h, bid in self.by_hash.items():
            if self.blocks[bid].hash != h:
                raise BlockAccountingError(f"hash table points block {bid} at a stale hash")
