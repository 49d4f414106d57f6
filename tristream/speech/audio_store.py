"""Per-stream audio buffers resident on the device, fed by pinned asynchronous uploads.

Each stream owns a row of one `[slots, max_samples]` tensor; a pushed chunk is pinned and copied
with `non_blocking=True` to the end of its row, so an update uploads only new audio, never the
whole buffer. Samples beyond a row's length are kept zero, so a batched pass gathers rows with
one indexed copy and gets Whisper's zero padding for free.
"""

from __future__ import annotations

import numpy as np
import torch

from tristream.speech.errors import AudioInputError


class AudioStore:
    """Device-resident audio rows for up to `slots` streams of at most `max_samples` each."""

    def __init__(self, slots: int, max_samples: int, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.max_samples = max_samples
        self.buf = torch.zeros(slots, max_samples, device=self.device)
        self.lengths = np.zeros(slots, dtype=np.int64)
        self._free = list(range(slots - 1, -1, -1))
        self.bytes_uploaded = 0

    def acquire(self) -> int:
        """A free row (raises when all are taken)."""
        if not self._free:
            raise AudioInputError(f"all {self.buf.shape[0]} audio slots are in use; close a stream or raise slots")
        return self._free.pop()

    def release(self, slot: int) -> None:
        """Return a row, zeroed."""
        self.buf[slot].zero_()
        self.lengths[slot] = 0
        self._free.append(slot)

    def append(self, slot: int, samples: np.ndarray) -> None:
        """Upload `samples` to the end of the row (the caller trims first when it would overflow)."""
        n = samples.shape[0]
        start = int(self.lengths[slot])
        if start + n > self.max_samples:
            raise AudioInputError(f"slot {slot} would hold {start + n} samples > {self.max_samples}; trim it first")
        src = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
        if self.device.type == "cuda":
            src = src.pin_memory()
        self.buf[slot, start : start + n].copy_(src, non_blocking=True)
        self.lengths[slot] = start + n
        self.bytes_uploaded += n * 4

    def trim(self, slot: int, n: int) -> None:
        """Drop the first `n` samples of the row (shift left on the device, zero the freed tail)."""
        length = int(self.lengths[slot])
        n = max(0, min(n, length))
        if n == 0:
            return
        row = self.buf[slot]
        row[: length - n] = row[n:length].clone()
        row[length - n : length].zero_()
        self.lengths[slot] = length - n

    def host_copy(self, slot: int) -> np.ndarray:
        """The row's samples on the host (tests and debugging; syncs)."""
        return self.buf[slot, : int(self.lengths[slot])].cpu().numpy()
