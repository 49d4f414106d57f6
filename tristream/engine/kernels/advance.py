"""The first kernel of a decode graph: advance the step's inputs on the device, and embed the ids.

A decode step's inputs (positions, cache slots, context lengths, block tables: `graphs.DecodeGraphs`)
change in a fixed way from one step of a batch to the next: every live row feeds the position after
the last one, into the next cache slot of its block table. Copying them from the host before every
step put a host→device copy between two decode graphs (~10 us of GPU time each on the H200,
bench/results/step_host.json at ccbc598). So the graph's first kernel moves them itself, steered by a flag word
that the host's copies carry:

- 1 (`FRESH`): the host has just copied the inputs; use them as they are and set the flag to 0;
- 0 (`ADVANCE`): no copy since the last replay; each row whose context is not empty (padded rows have
  context 0) moves on: position + 1, context + 1, slot = the new cache index's place in its block
  table (the host copies again whenever that table lacks the block, or the batch changes:
  `decode_chain.ChainedDecode`);
- 2 (`HOLD`): leave everything (benchmarks that replay one step many times).

The same kernel gathers the embeddings of the step's ids (one program per row; program 0 also does
the advance, which no other program reads), so the graph gains no launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _advance_embed_kernel(buf_ptr, emb_ptr, out_ptr, ROWS, H, BS, OFF_POS, OFF_SLOT, OFF_CTX, OFF_BT, OFF_FLAG,
                          MB, RP2: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    tok = tl.load(buf_ptr + row).to(tl.int64)  # the ids are the buffer's first rows
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(emb_ptr + tok * H + offs, mask=offs < H)
        tl.store(out_ptr + row * H + offs, x, mask=offs < H)
    if row == 0:
        flag = tl.load(buf_ptr + OFF_FLAG)
        if flag == 1:
            tl.store(buf_ptr + OFF_FLAG, 0)
        elif flag == 0:
            r = tl.arange(0, RP2)
            ctx = tl.load(buf_ptr + OFF_CTX + r, mask=r < ROWS, other=0)
            live = (r < ROWS) & (ctx > 0) & (ctx // BS < MB)  # the host never lets the table run out
            ci = ctx  # the new cache index: the last one (ctx - 1) plus one
            blk = tl.load(buf_ptr + OFF_BT + r * MB + ci // BS, mask=live, other=0)
            pos = tl.load(buf_ptr + OFF_POS + r, mask=live, other=0)
            tl.store(buf_ptr + OFF_POS + r, pos + 1, mask=live)
            tl.store(buf_ptr + OFF_SLOT + r, blk * BS + ci % BS, mask=live)
            tl.store(buf_ptr + OFF_CTX + r, ctx + 1, mask=live)


def advance_embed(buf: torch.Tensor, embed: torch.Tensor, rows: int, block_size: int, off_pos: int, off_slot: int,
                  off_ctx: int, off_bt: int, off_flag: int, max_blocks: int) -> torch.Tensor:
    """Advance the first `rows` rows of the decode input buffer `buf` (int32, the ids at its start;
    see the module docstring) and return the embeddings [rows, hidden] of their ids (`embed`:
    [vocab, hidden], contiguous)."""
    if buf.dtype != torch.int32 or not buf.is_contiguous():
        raise ValueError(f"advance_embed needs a contiguous int32 input buffer, got {buf.dtype}")
    if embed.dim() != 2 or not embed.is_contiguous():
        raise ValueError(f"advance_embed needs a contiguous [vocab, hidden] embedding, got {tuple(embed.shape)}")
    hidden = embed.shape[1]
    out = torch.empty(rows, hidden, dtype=embed.dtype, device=embed.device)
    _advance_embed_kernel[(rows,)](buf, embed, out, rows, hidden, block_size, off_pos, off_slot, off_ctx, off_bt,
                                   off_flag, max_blocks, RP2=max(triton.next_power_of_2(rows), 16),
                                   BLOCK_H=min(triton.next_power_of_2(hidden), 1024), num_warps=4)
    return out
