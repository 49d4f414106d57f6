"""`FrameTokenizer`: camera frames → LLM-space vision tokens, on the device, ready for incremental prefill.

One per process, shared by every session: frames (HxWx3 uint8 RGB, any size) go through the
`FramePreprocessor` (pinned upload, on-device resize and normalisation), a SigLIP tower, saliency
pruning (`keep_ratio`: the most salient patches by feature norm) and a LLaVA projector into the
language model's hidden size; each frame comes back as a `[k, hidden]` tensor on the device, in the
engine's dtype, which `LLMEngine.append(embeddings=...)` puts into a session's context.

Weights: a VLM folder's tower and projector (`from_vlm`), or, where no VLM weights exist (none are
available offline here), `random` builds SigLIP-B/16 at 224 px and a projector with random
weights: the mechanism and its cost are real, what the tokens mean is not. ``weights`` says which.
With random weights the tokens are scaled to the RMS of the language model's token embeddings
(``match_rms``), so that they perturb the prompt no more than ordinary tokens do.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tristream.vision.connector import LlavaProjector
from tristream.vision.pruning import keep_count, prune_tokens
from tristream.vision.vit import VisionTower, VisionTowerConfig

SIGLIP_B16_224 = VisionTowerConfig(kind="siglip", hidden_size=768, intermediate_size=3072, num_layers=12,
                                   num_heads=12, image_size=224, patch_size=16)
"""google/siglip-base-patch16-224's tower shape (196 patches)."""


@dataclass(slots=True)
class FrameTokenizerStats:
    """Frames encoded, batches, tokens out, patches pruned and the time in `encode` (s)."""

    frames: int = 0
    batches: int = 0
    tokens: int = 0
    pruned: int = 0
    encode_s: float = 0.0


class FrameTokenizer:
    """See the module docstring. `encode` is thread-safe (one forward at a time)."""

    def __init__(self, tower: VisionTower, projector: torch.nn.Module, device: str | torch.device,
                 dtype: torch.dtype, keep_ratio: float = 0.25, weights: str = "vlm",
                 match_rms: float | None = None) -> None:
        from tristream.vision.preprocess import FramePreprocessor

        self.device = torch.device(device)
        self.dtype = dtype
        self.tower = tower.to(device=self.device, dtype=dtype).eval()
        self.projector = projector.to(device=self.device, dtype=dtype).eval()
        self.keep_ratio = keep_ratio
        self.weights = weights
        self.match_rms = match_rms
        self.pre = FramePreprocessor(tower.cfg.image_size, device=self.device, dtype=dtype)
        self.stats = FrameTokenizerStats()
        self._lock = threading.Lock()

    @property
    def tokens_per_frame(self) -> int:
        """Vision tokens one frame gives the LLM (after pruning)."""
        return keep_count(self.tower.cfg.num_patches, self.keep_ratio)

    @classmethod
    def random(cls, hidden_size: int, device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
               keep_ratio: float = 0.25, match_rms: float | None = None, seed: int = 0,
               cfg: VisionTowerConfig = SIGLIP_B16_224) -> FrameTokenizer:
        """SigLIP-B/16 and a LLaVA projector into ``hidden_size`` with random weights (labelled
        ``weights="random"``): N(0, 0.02) matrices, unit norms, zero biases."""
        gen = torch.Generator().manual_seed(seed)
        tower = VisionTower(cfg)
        proj = LlavaProjector(cfg.hidden_size, hidden_size, act="gelu")
        with torch.no_grad():
            for mod in (tower, proj):
                for name, p in mod.named_parameters():
                    if "ln" in name.split(".")[-2:][0] and name.endswith("weight"):
                        p.fill_(1.0)
                    elif p.dim() >= 2:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
                    else:
                        p.zero_()
        return cls(tower, proj, device, dtype, keep_ratio, "random", match_rms)

    @classmethod
    def from_vlm(cls, vlm: Any, device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
                 keep_ratio: float = 0.25) -> FrameTokenizer:
        """The tower and LLaVA projector of a `VisionLanguageModel` (real weights)."""
        return cls(vlm.tower, vlm.connector, device, dtype, keep_ratio, "vlm")

    @torch.inference_mode()
    def encode(self, frames: list[np.ndarray]) -> list[torch.Tensor]:
        """One batched forward: a `[k, hidden]` token tensor per frame (on the device)."""
        import time

        if not frames:
            return []
        with self._lock:
            t0 = time.perf_counter()
            pixels = self.pre(frames)
            out = self.tower(pixels, layer=None, saliency="norm" if self.keep_ratio < 1.0 else None)
            feats, sal = out.features, out.saliency
            if sal is not None:
                p = prune_tokens(feats, sal, self.keep_ratio)
                feats = p.tokens
                self.stats.pruned += p.dropped
            emb = self.projector(feats)
            if self.match_rms is not None:
                rms = emb.float().pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
                emb = (emb.float() * (self.match_rms / rms)).to(self.dtype)
            res = [emb[i].contiguous() for i in range(emb.shape[0])]
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # ready for another thread's stream
            self.stats.encode_s += time.perf_counter() - t0
            self.stats.frames += len(frames)
            self.stats.batches += 1
            self.stats.tokens += int(emb.shape[0] * emb.shape[1])
            return res


def embedding_rms(model: Any) -> float:
    """RMS of a language model's token embedding rows (the scale random vision tokens are given)."""
    w = getattr(model, "embed_tokens", None)
    weight = getattr(w, "weight", w)
    if not isinstance(weight, torch.Tensor):
        return 1.0
    return float(weight.float().pow(2).mean().sqrt())
