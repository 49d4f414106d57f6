"""The host's side of a decode graph's inputs advancing on the device (`kernels/advance.py`).

The flag word of `graphs.DecodeGraphs`' input buffer: ADVANCE (0: the graph's first kernel moves
every live row to its next position), FRESH (1: the host has just copied the inputs; use them and
set ADVANCE), HOLD (2: use them, every replay). `InputState` is the host's mirror of what a replay
computes with, so that a chained step knows when it may skip its copy (`decode_chain`). No Triton
here: the CPU engine imports this.
"""

from __future__ import annotations

import dataclasses

import torch

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

def advance_reference(buf: torch.Tensor, rows: int, block_size: int, off_pos: int, off_slot: int, off_ctx: int,
                      off_bt: int, off_flag: int, max_blocks: int) -> None:
    """What `kernels/advance.advance_embed` does to the input buffer `buf` (int32, the layout of
    `graphs.DecodeGraphs`), in torch: the reference of its tests."""
    flag = int(buf[off_flag])
    if flag == FRESH:
        buf[off_flag] = ADVANCE
        return
    if flag != ADVANCE:
        return
    for r in range(rows):
        ctx = int(buf[off_ctx + r])
        if ctx <= 0 or ctx // block_size >= max_blocks:  # padded rows; a table the host let run out
            continue
        blk = int(buf[off_bt + r * max_blocks + ctx // block_size])
        buf[off_pos + r] += 1
        buf[off_slot + r] = blk * block_size + ctx % block_size
        buf[off_ctx + r] = ctx + 1
