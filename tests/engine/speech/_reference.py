"""Plain reference loops of the word-timing code, for its tests."""

from __future__ import annotations

import numpy as np


def dtw_reference(cost: np.ndarray) -> list[int]:
    """Plain O(N·M) DTW (whisper's loop) on one `[N, M]` cost; entry frame per row. For tests."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.zeros((n + 1, m + 1), dtype=np.int64)
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c = (acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])
            k = int(np.argmin(c))
            acc[i, j] = cost[i - 1, j - 1] + c[k]
            trace[i, j] = k
    i, j = n, m
    starts = [0] * n
    while i > 0 and j > 0:
        starts[i - 1] = j - 1
        t = trace[i, j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    return starts
