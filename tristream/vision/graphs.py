"""CUDA-graph bucket bank for a vision forward, keyed by image count.

Each bucket (1, 2, 4, … images) is captured once, largest first, into one shared memory pool
with one static input buffer sliced per bucket; a call copies its pixels into the buffer,
replays the smallest bucket that holds them and returns views of the static outputs (valid
until the next call: clone to keep). Off CUDA, or with graphs disabled, the same call runs eager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tristream.engine.graph_capture import capture_buckets
from tristream.vision.errors import VisionInputError

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(slots=True)
class GraphBankStats:
    """Counters: replays per bucket, padded image slots, eager calls, captures."""

    replays: dict[int, int] = field(default_factory=dict)
    padded_images: int = 0
    eager_calls: int = 0
    captured: int = 0


class VisionGraphBank:
    """Run `fn(pixels [n, C, S, S])` through per-image-count CUDA graphs."""

    def __init__(self, fn: Callable[[torch.Tensor], Outputs], image_shape: tuple[int, int, int],
                 buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32), device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.float16, use_graphs: bool | None = None) -> None:
        self.fn = fn
        self.buckets = tuple(sorted(set(buckets)))
        self.device = torch.device(device)
        self.dtype = dtype
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.static_in = torch.zeros(self.buckets[-1], *image_shape, device=self.device, dtype=dtype)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outs: dict[int, Outputs] = {}
        self.stats = GraphBankStats()

    def bucket(self, n: int) -> int:
        """Smallest bucket holding `n` images."""
        for b in self.buckets:
            if b >= n:
                return b
        raise VisionInputError(f"{n} images exceed the largest bucket {self.buckets[-1]}; call in chunks")

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up, then capture every bucket (largest first) into one pool."""
        if not self.use_graphs or self._graphs:
            return
        with torch.cuda.device(self.device):
            self._graphs, self._outs, _ = capture_buckets(self.buckets, lambda b: self.fn(self.static_in[:b]))
        self.stats.captured += len(self._graphs)

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> Outputs:
        """Outputs for `pixels` `[n, C, S, S]` (n ≤ largest bucket); graph outputs are views."""
        n = pixels.shape[0]
        if pixels.shape[1:] != self.static_in.shape[1:]:
            raise VisionInputError(f"pixels {tuple(pixels.shape)} do not match the bank's "
                                   f"{tuple(self.static_in.shape[1:])} images")
        if not self.use_graphs:
            self.stats.eager_calls += 1
            return self.fn(pixels.to(self.device, self.dtype))
        b = self.bucket(n)
        if not self._graphs:
            self.capture()
        self.static_in[:n].copy_(pixels, non_blocking=True)
        self._graphs[b].replay()
        self.stats.replays[b] = self.stats.replays.get(b, 0) + 1
        self.stats.padded_images += b - n
        out = self._outs[b]
        if isinstance(out, tuple):
            return tuple(o[:n] for o in out)
        return out[:n]
