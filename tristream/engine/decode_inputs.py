"""The host's side of a decode graph's inputs advancing on the device (`kernels/advance.py`).

The flag word of `graphs.DecodeGraphs`' input buffer: ADVANCE (0: the graph's first kernel moves
every live row to its next position), FRESH (1: the host has just copied the inputs; use them and
set ADVANCE), HOLD (2: use them, every replay). `InputState` is the host's mirror of what a replay
computes with, so that a chained step knows when it may skip its copy (`decode_chain`). No Triton
here: the CPU engine imports this.
"""

from __future__ import annotations

import dataclasses

ADVANCE, FRESH, HOLD = 0, 1, 2


@dataclasses.dataclass(frozen=True, slots=True)
class InputState:
    """What a decode replay computes with, as the host knows it: the bucket, and per live row the
    sequence, the cache index it feeds and its block table's length (the device copy holds that
    many entries)."""

    bucket: int
    seq_ids: tuple[int, ...]
    cis: tuple[int, ...]
    nbt: tuple[int, ...]

    def advanced(self, nxt: InputState, block_size: int) -> bool:
        """Whether a replay's advance kernel turns these inputs into `nxt`: same bucket and rows,
        every cache index one further, block tables unchanged and covering it."""
        return (nxt.bucket == self.bucket and nxt.seq_ids == self.seq_ids and nxt.nbt == self.nbt
                and all(c == p + 1 and c // block_size < n for c, p, n in zip(nxt.cis, self.cis, nxt.nbt, strict=True)))
