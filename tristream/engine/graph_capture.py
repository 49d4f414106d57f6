"""Capture one CUDA graph per bucket: warm-up on a side stream, then largest first into one pool.

Shared by the decode graphs (`graphs.DecodeGraphs`), the small-prefill graphs
(`prefill_graphs.PrefillGraphs`), the Whisper passes (`speech.runner.WhisperRunner`) and the
vision bank (`vision.graphs.VisionGraphBank`). Warm-up runs every bucket eagerly (Triton compiles its
kernels, cuBLAS creates its handles and workspaces) on a side stream, as graph capture
requires; capturing the largest bucket first lets the smaller ones reuse its memory.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparisonT as Key
else:
    Key = TypeVar("Key")
Out = TypeVar("Out")


def capture_buckets(buckets: Iterable[Key], forward: Callable[[Key], Out], pool: Any = None,
                    warm: Callable[[Key], Any] | None = None, rounds: int = 2,
                    between: Callable[[], None] | None = None
                    ) -> tuple[dict[Key, torch.cuda.CUDAGraph], dict[Key, Out], Any]:
    """Graphs and their static outputs per bucket, and the memory pool they share.

    Buckets are captured in descending order (a bucket is an int, or a tuple whose leading
    sizes sort the largest first). ``warm``: what the warm-up runs per bucket (default
    ``forward``); ``between``: called after the warm-up and before capture (e.g. to time
    kernel variants)."""
    order = sorted(buckets, reverse=True)
    warm = warm or forward
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(rounds):
            for b in order:
                warm(b)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if between is not None:
        between()
        torch.cuda.synchronize()
    graphs: dict[Key, torch.cuda.CUDAGraph] = {}
    outputs: dict[Key, Out] = {}
    # no garbage collection inside a capture: collecting another engine's graphs, events or pinned
    # buffers there (reference cycles) is an operation a capturing stream does not permit
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for b in order:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                outputs[b] = forward(b)
            if pool is None:
                pool = g.pool()
            graphs[b] = g
    finally:
        if was_enabled:
            gc.enable()
    torch.cuda.synchronize()
    return graphs, outputs, pool
