"""Plain-torch references of device kernels, for their tests."""

from __future__ import annotations

import torch

from tristream.engine.decode_inputs import ADVANCE, FRESH


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
