"""Requests, sampling parameters and the engine's per-sequence state.

A sequence's context is a list of *keys*, one per position: a token id (≥ 0), or a negative
key for a position filled by a precomputed embedding (vision tokens). The embeddings are kept
beside the keys as (start position, tensor) segments. `num_computed` counts the logical
positions computed so far (their K/V are in the cache unless KV retention evicted them);
everything after it is pending prefill.

Logical position vs cache index (KV retention, `kv_retention.py`): a key's index in `keys` is
its *logical position* (what RoPE sees). Its *cache index* is where its K/V live under the
block table. Without eviction the two are equal. Evicting whole, full, computed blocks from the
block table shifts every later cache index down by a multiple of the block size; since only
computed blocks are evicted, every position at or after the cache's write point has
`cache index = logical position - cache_offset` (O(1) per sequence on the hot paths).
After preemption a sequence keeps its evictions and recomputes only its kept blocks:
`num_computed` then restarts at `cache_offset` (cache index 0) and `positions()` maps the
kept blocks before the last evicted one back to their logical positions.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable

import numpy as np
import torch

LogitsMask = Callable[[list[int]], "torch.Tensor | None"]
"""A per-sequence constraint on the next token: called with the tokens generated so far, it returns
a bool tensor [vocab] of the allowed ones (None: no constraint this step)."""


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logits_mask: LogitsMask | None = None
    """Constrained decoding (e.g. `constrain.JsonConstraint`): such a sequence always takes the
    general sampling path (no graph argmax, no overlapped decode)."""

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_tokens < 0:
            raise ValueError(
                f"bad sampling params: temperature={self.temperature} (≥0), top_p={self.top_p} (0,1], "
                f"top_k={self.top_k} (≥0), max_tokens={self.max_tokens} (≥0)"
            )
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # no KV blocks held (new or preempted)
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"


class FinishReason(enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"
    CANCELLED = "cancelled"
    ERROR = "error"


_ids = itertools.count(1)
_embed_keys = itertools.count(1)


def embedding_keys(n: int, cache_key: str | None) -> list[int]:
    """Negative keys for n embedding positions; equal cache keys give equal keys (prefix hits)."""
    if cache_key is None:
        base = next(_embed_keys) << 20
        return [-(base + i + 1) for i in range(n)]
    h = abs(hash(("embed", cache_key))) % (1 << 40)
    return [-((h << 20) + i + 1) for i in range(n)]


@dataclasses.dataclass(slots=True, eq=False)
class Sequence:
    """One sequence's context, cache blocks and generation state."""

    keys: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    priority: int = 0  # higher runs first and is preempted last
    deadline: float | None = None  # seconds on the engine clock; earlier first within a priority
    generating: bool = True  # False: an open context still receiving input (incremental prefill)
    seq_id: int = dataclasses.field(default_factory=lambda: next(_ids))
    arrival: int = 0
    embeds: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    block_table: list[int] = dataclasses.field(default_factory=list)
    num_published: int = 0  # leading blocks registered in the prefix cache
    last_hash: int | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt positions served from the prefix cache
    kv_budget_tokens: int | None = None  # KV retention budget (None: the engine's default)
    cache_offset: int = 0  # logical positions evicted from the cache (a multiple of the block size)
    evicted_blocks: list[int] = dataclasses.field(default_factory=list)  # logical block indices, sorted

    @property
    def num_pending(self) -> int:
        return len(self.keys) - self.num_computed

    @property
    def cache_len(self) -> int:
        """Positions whose K/V are held in the cache (computed minus evicted)."""
        return self.num_computed - self.cache_offset

    def head_end(self, block_size: int) -> int:
        """Cache index where the shifted tail starts: before it, kept blocks lie between evicted
        ones (0 without eviction). Positions still to compute are past it, except while a
        preempted sequence recomputes its kept blocks."""
        if not self.evicted_blocks:
            return 0
        return (self.evicted_blocks[-1] + 1 - len(self.evicted_blocks)) * block_size

    def positions(self, start: int, end: int, block_size: int) -> np.ndarray | None:
        """Logical positions of the positions counted [start, end) by `num_computed`, or None when
        they are start..end-1: always without eviction and past `head_end` (O(1) then)."""
        off = self.cache_offset
        head = self.head_end(block_size)
        if start - off >= head:
            return None
        c = np.arange(start - off, end - off, dtype=np.int64)
        kept = np.setdiff1d(np.arange(self.evicted_blocks[-1] + 1, dtype=np.int64),
                            np.asarray(self.evicted_blocks, dtype=np.int64))
        out = c + off
        m = c < head
        out[m] = kept[c[m] // block_size] * block_size + c[m] % block_size
        return out

    def logical_blocks(self) -> list[int]:
        """Logical block index of each block-table entry, in cache order (eviction time only: O(n))."""
        if not self.evicted_blocks:
            return list(range(len(self.block_table)))
        gone = set(self.evicted_blocks)
        out: list[int] = []
        i = 0
        while len(out) < len(self.block_table):
            if i not in gone:
                out.append(i)
            i += 1
        return out

    @property
    def is_decode(self) -> bool:
        """Generating with exactly the last sampled token left to feed."""
        return self.generating and self.status is SeqStatus.RUNNING and self.num_pending == 1 and bool(
            self.output_ids
        )

    def sort_key(self) -> tuple[int, float, int]:
        """Order of service: priority (high first), deadline (early first), arrival."""
        return (-self.priority, self.deadline if self.deadline is not None else float("inf"), self.arrival)
