"""The host's side of decode inputs that advance on the device (`decode_inputs.py`): when a chained
step may skip its copy, and what the advance does to the buffer (the reference of the GPU kernel,
tests/engine/test_advance_kernel.py)."""

from __future__ import annotations

import torch

from tests.engine._reference import advance_reference
from tristream.engine.decode_inputs import ADVANCE, FRESH, HOLD, InputState

BS = 16


def test_a_step_one_position_on_with_the_same_rows_and_tables_advances() -> None:
    last = InputState(2, (7, 9), (30, 15), (2, 1))
    assert last.advanced(InputState(2, (7, 9), (31, 16), (2, 2)), BS) is False  # row 1 gained a block: copy
    assert last.advanced(InputState(2, (7, 9), (31, 16), (2, 1)), BS) is False  # 16 // 16 = block 1: not in its table
    last = InputState(2, (7, 9), (30, 14), (2, 1))
    assert last.advanced(InputState(2, (7, 9), (31, 15), (2, 1)), BS) is True
    assert last.advanced(InputState(4, (7, 9), (31, 15), (2, 1)), BS) is False  # another bucket
    assert last.advanced(InputState(2, (9, 7), (31, 15), (2, 1)), BS) is False  # rows swapped
    assert last.advanced(InputState(2, (7, 9), (32, 15), (2, 1)), BS) is False  # a position skipped (or evicted)
    assert last.advanced(InputState(2, (7, 9), (30, 15), (2, 1)), BS) is False  # a row did not move


def _buffer(rows: int, mb: int) -> tuple[torch.Tensor, dict[str, int]]:
    n = 4
    off = {"off_pos": n + 1, "off_slot": 2 * n + 1, "off_ctx": 3 * n + 1, "off_bt": 4 * n + 1, "off_flag": n}
    buf = torch.zeros(4 * n + 1 + n * mb, dtype=torch.int32)
    return buf, off


def test_reference_advance_fresh_and_hold() -> None:
    buf, off = _buffer(3, 4)
    mb = 4
    # row 0: context 16 (cache index 15 fed, at position 20); row 1: context 3; row 2: padding
    for r, (pos, ctx, bt) in enumerate([(20, 16, [5, 8]), (2, 3, [3]), (0, 0, [])]):
        buf[off["off_pos"] + r] = pos
        buf[off["off_ctx"] + r] = ctx
        buf[off["off_slot"] + r] = -1 if ctx == 0 else 99
        buf[off["off_bt"] + r * mb:off["off_bt"] + r * mb + len(bt)] = torch.tensor(bt, dtype=torch.int32)
    buf[off["off_flag"]] = FRESH
    before = buf.clone()
    advance_reference(buf, 3, BS, max_blocks=mb, **off)
    assert int(buf[off["off_flag"]]) == ADVANCE
    buf[off["off_flag"]] = ADVANCE
    assert torch.equal(buf, before.index_fill(0, torch.tensor([off["off_flag"]]), ADVANCE))  # fresh: untouched
    advance_reference(buf, 3, BS, max_blocks=mb, **off)
    o = off
    assert [int(buf[o["off_pos"] + r]) for r in range(3)] == [21, 3, 0]
    assert [int(buf[o["off_ctx"] + r]) for r in range(3)] == [17, 4, 0]
    assert [int(buf[o["off_slot"] + r]) for r in range(3)] == [8 * BS + 0, 3 * BS + 3, -1]  # row 0 enters block 8
    held = buf.clone()
    buf[o["off_flag"]] = HOLD
    held[o["off_flag"]] = HOLD
    advance_reference(buf, 3, BS, max_blocks=mb, **off)
    assert torch.equal(buf, held)
