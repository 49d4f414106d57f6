"""`fork_map`: run a few pure functions side by side in forked processes (POSIX), results pickled back.

`tristream align` splits its bulk work (decoding, the per-source fits, writing) into one part
per core. The work holds the GIL (msgspec builds Python objects, the writer formats bytes), so
threads would not help; forked children share the parent's memory (the file's bytes) without
copying it. A child that fails is redone in the parent, so the result never depends on it.
"""

from __future__ import annotations

import mmap
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")
R = TypeVar("R")


def usable_cores() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def free_cores() -> int:
    """Usable cores not busy with other work: the usable cores less the 1-minute load average,
    at least 1. On a machine whose cores are taken, forked parts only share a core and pay for
    the forking (two parts of `tristream align` ran 1.3-2x slower than one on a 2-core machine
    with a load of 3)."""
    cores = usable_cores()
    try:
        load = os.getloadavg()[0]
    except OSError:
        return cores
    return max(1, min(cores, int(cores - load + 0.5)))


def shared_empty(n: int, dtype: Any) -> np.ndarray:
    """An uninitialised 1-d array in memory shared with the processes forked after this call (a
    child writes its results there instead of sending them back through a pipe)."""
    dt = np.dtype(dtype)
    buf = mmap.mmap(-1, max(1, n * dt.itemsize))  # anonymous and MAP_SHARED
    return np.frombuffer(buf, dt, count=n)


def fork_map(fn: Callable[[T], R], parts: Sequence[T]) -> list[R]:
    """`[fn(p) for p in parts]`, the first part in this process and each other one in a forked child.

    Without `os.fork` (or with one part) everything runs here. A child that raises or dies is
    redone here, so an error surfaces from this process with its own traceback.
    """
    if len(parts) <= 1 or not hasattr(os, "fork"):
        return [fn(p) for p in parts]
    children: list[tuple[int, int]] = []
    for p in parts[1:]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: compute, send, leave without running the parent's exit handlers
            os.close(r)
            status = 0
            try:
                payload = pickle.dumps(fn(p), protocol=pickle.HIGHEST_PROTOCOL)
                with os.fdopen(w, "wb") as fh:
                    fh.write(payload)
            except BaseException:
                status = 1
            os._exit(status)
        os.close(w)
        children.append((pid, r))
    results: list[R] = []
    try:
        results.append(fn(parts[0]))
    finally:
        got: list[bytes | None] = []
        for pid, r in children:
            with os.fdopen(r, "rb") as fh:
                blob = fh.read()
            _, status = os.waitpid(pid, 0)
            got.append(blob if status == 0 and blob else None)
    for p, data in zip(parts[1:], got, strict=True):
        results.append(pickle.loads(data) if data is not None else fn(p))
    return results
