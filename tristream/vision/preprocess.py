"""GPU preprocessing of camera frames: uint8 HxWx3 → resized, normalised `[n, 3, S, S]` pixels.

Frames are copied into one of two pinned host staging buffers and uploaded with non-blocking
copies on a dedicated upload stream; the compute stream waits on an event, so the copy of the
next batch overlaps the encoder of this one. Resize (bilinear or bicubic, antialiased like PIL)
and normalisation run on the device as three kernels per frame size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tristream.vision.errors import VisionInputError

SIGLIP_MEAN_STD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
CLIP_MEAN_STD = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


@dataclass(slots=True)
class PreprocessStats:
    """Counters: frames and batches handled, bytes uploaded, waits for a busy staging buffer."""

    frames: int = 0
    batches: int = 0
    bytes_uploaded: int = 0
    staging_waits: int = 0
    sizes: dict[tuple[int, int], int] = field(default_factory=dict)


class FramePreprocessor:
    """Pinned, double-buffered uploads and on-device resize + normalise for a vision tower."""

    def __init__(
        self,
        image_size: int,
        mean_std: tuple[tuple[float, float, float], tuple[float, float, float]] = SIGLIP_MEAN_STD,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        interpolation: str = "bicubic",
        max_batch: int = 32,
        max_hw: tuple[int, int] = (1080, 1920),
    ) -> None:
        if interpolation not in ("bilinear", "bicubic"):
            raise VisionInputError(f"interpolation {interpolation!r} is not 'bilinear' or 'bicubic'")
        self.size = image_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.mode = interpolation
        self.max_batch = max_batch
        self.max_hw = max_hw
        mean, std = mean_std
        self.scale = (1.0 / (255.0 * torch.tensor(std))).view(1, 3, 1, 1).to(self.device)
        self.shift = (-torch.tensor(mean) / torch.tensor(std)).view(1, 3, 1, 1).to(self.device)
        self.cuda = self.device.type == "cuda"
        self.stats = PreprocessStats()
        self._staging: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._turn = 0
        if self.cuda:
            self._upload = torch.cuda.Stream(self.device)
            self._staging = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
            self._events = [None, None]

    def _check(self, frames: list[np.ndarray]) -> None:
        if not frames:
            raise VisionInputError("no frames to preprocess")
        if len(frames) > self.max_batch:
            raise VisionInputError(f"{len(frames)} frames exceed max_batch={self.max_batch}; split the batch")
        for i, f in enumerate(frames):
            if f.dtype != np.uint8 or f.ndim != 3 or f.shape[2] != 3:
                raise VisionInputError(f"frame {i} is {f.dtype} {f.shape}; expected uint8 HxWx3 (RGB)")
            if f.shape[0] > self.max_hw[0] or f.shape[1] > self.max_hw[1]:
                raise VisionInputError(f"frame {i} is {f.shape[0]}x{f.shape[1]}, larger than max_hw={self.max_hw}")

    def _upload_group(self, group: list[np.ndarray]) -> torch.Tensor:
        """uint8 `[n, H, W, 3]` on the device (pinned async copy on CUDA)."""
        batch = np.stack(group)
        if not self.cuda:
            return torch.from_numpy(batch)
        k = self._turn
        self._turn ^= 1
        ev = self._events[k]
        if ev is not None and not ev.query():
            self.stats.staging_waits += 1
            ev.synchronize()
        if self._staging[k].numel() < batch.size:  # grow (pinned allocations are slow: only on a new maximum)
            self._staging[k] = torch.empty(batch.size, dtype=torch.uint8, pin_memory=True)
        host = self._staging[k][: batch.size]
        host.numpy()[:] = batch.reshape(-1)
        with torch.cuda.stream(self._upload):
            dev = host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._upload)
        self._events[k] = done
        torch.cuda.current_stream(self.device).wait_event(done)
        dev.record_stream(torch.cuda.current_stream(self.device))
        self.stats.bytes_uploaded += batch.size
        return dev.view(batch.shape)

    def __call__(self, frames: list[np.ndarray] | np.ndarray) -> torch.Tensor:
        """Frames (list of HxWx3 uint8, sizes may differ) → `[n, 3, S, S]` normalised pixels."""
        seq = list(frames) if isinstance(frames, np.ndarray) and frames.ndim == 4 else frames
        if isinstance(seq, np.ndarray):
            seq = [seq]
        self._check(seq)
        out = torch.empty(len(seq), 3, self.size, self.size, device=self.device, dtype=self.dtype)
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, f in enumerate(seq):
            by_size.setdefault((f.shape[0], f.shape[1]), []).append(i)
        for hw, idx in by_size.items():
            x = self._upload_group([seq[i] for i in idx]).permute(0, 3, 1, 2).float()
            if hw != (self.size, self.size):
                x = F.interpolate(x, size=(self.size, self.size), mode=self.mode, antialias=True,
                                  align_corners=False)
            x = x * self.scale + self.shift
            out[torch.tensor(idx, device=self.device)] = x.to(self.dtype)
            self.stats.sizes[hw] = self.stats.sizes.get(hw, 0) + len(idx)
        self.stats.frames += len(seq)
        self.stats.batches += 1
        return out
