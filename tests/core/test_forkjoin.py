"""fork_map: results in order, a failed child's part redone here, shared memory seen by both."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tristream.core.forkjoin import fork_map, free_cores, shared_empty, usable_cores

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def test_results_in_order_and_shared_memory() -> None:
    out = shared_empty(8, np.int64)
    out[:] = 0

    def part(k: int) -> tuple[int, int]:
        out[k] = k * k  # written in a child for k > 0, seen here
        return k, os.getpid()

    got = fork_map(part, range(8))
    assert [k for k, _ in got] == list(range(8))
    assert got[0][1] == os.getpid() and all(pid != os.getpid() for _, pid in got[1:])
    assert out.tolist() == [k * k for k in range(8)]


def test_a_failed_child_is_redone_here() -> None:
    me = os.getpid()

    def part(k: int) -> int:
        if os.getpid() != me and k == 2:
            raise RuntimeError("child failure")
        return 10 * k

    assert fork_map(part, [0, 1, 2, 3]) == [0, 10, 20, 30]
    with pytest.raises(ValueError, match="here too"):
        fork_map(lambda k: (_ for _ in ()).throw(ValueError("here too")) if k == 1 else k, [0, 1])


def test_free_cores_bounds() -> None:
    assert 1 <= free_cores() <= usable_cores()
