"""Property tests of the KV block manager: no leak, no double free, reference counts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.engine.block_manager import BlockAccountingError, BlockManager, OutOfBlocks

BS = 4

ops = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.lists(st.integers(0, 3), min_size=0, max_size=14)),
        st.tuples(st.just("free"), st.integers(0, 50)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_workload_keeps_invariants(workload: list) -> None:
    bm = BlockManager(num_blocks=12, block_size=BS)
    live: list[tuple[list[int], list[int]]] = []  # (block ids, keys) held by "sequences"
    for op, arg in workload:
        if op == "new":
            keys = arg
            blocks, prev = bm.match_prefix(keys)
            try:
                while len(blocks) * BS < len(keys):
                    blocks.append(bm.allocate())
            except OutOfBlocks:
                bm.release(blocks)
                bm.check()
                continue
            for i in range(len(blocks)):  # publish every full block, as the engine does after compute
                if (i + 1) * BS <= len(keys) and bm.blocks[blocks[i]].hash is None:
                    prev = bm.publish(blocks[i], prev if i else None, tuple(keys[i * BS:(i + 1) * BS]))
                elif bm.blocks[blocks[i]].hash is not None:
                    prev = bm.blocks[blocks[i]].hash
            live.append((blocks, keys))
        elif live:
            blocks, _ = live.pop(arg % len(live))
            bm.release(blocks)
        bm.check()
        held: dict[int, int] = {}
        for blocks, _ in live:
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        for b in bm.blocks:  # reference counts equal the references sequences hold
            assert b.ref_count == held.get(b.block_id, 0)
        assert bm.num_free == bm.num_blocks - len(held)
        for blocks, keys in live:  # a shared block holds exactly the keys of every holder
            for i, b in enumerate(blocks):
                if bm.blocks[b].hash is not None and (i + 1) * BS <= len(keys):
                    assert bm.blocks[b].keys == tuple(keys[i * BS:(i + 1) * BS])
    for blocks, _ in live:
        bm.release(blocks)
    bm.check()
    assert bm.num_free == bm.num_blocks  # no leak


def test_double_free_is_detected() -> None:
    bm = BlockManager(4, BS)
    b = bm.allocate()
    bm.release([b])
    with pytest.raises(BlockAccountingError):
        bm.release([b])


def test_prefix_hit_is_verified_against_keys() -> None:
    bm = BlockManager(8, BS)
    a = [bm.allocate(), bm.allocate()]
    h = bm.publish(a[0], None, (1, 2, 3, 4))
    bm.publish(a[1], h, (5, 6, 7, 8))
    bm.release(a)
    hit, _ = bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hit == a and all(bm.blocks[b].ref_count == 1 for b in a)
    bm.release(hit)
    # a forged collision: same hash entry, different keys, must not alias
    bm.blocks[a[0]].keys = (9, 9, 9, 9)
    miss, _ = bm.match_prefix([1, 2, 3, 4])
    assert miss == []
    assert bm.stats.prefix_hits == 2


def test_out_of_blocks_raises() -> None:
    bm = BlockManager(2, BS)
    bm.allocate()
    bm.allocate()
    with pytest.raises(OutOfBlocks):
        bm.allocate()
