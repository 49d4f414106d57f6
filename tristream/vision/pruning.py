"""Dynamic vision-token pruning: keep the top-k tokens of each image by a saliency score.

The score comes from the tower (`TowerOutput.saliency`: feature norm or pooled attention);
kept tokens stay in their original order so the LLM still sees a raster scan. `k` depends only
on the token count and the ratio, so a pruned forward keeps static shapes (graph-capturable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tristream.vision.errors import VisionInputError


def keep_count(n_tokens: int, keep_ratio: float) -> int:
    """Tokens kept of `n_tokens` at `keep_ratio` (at least one)."""
    if not 0.0 < keep_ratio <= 1.0:
        raise VisionInputError(f"keep_ratio must be in (0, 1]; got {keep_ratio} (prune ratio 75% is keep 0.25)")
    return max(1, int(round(n_tokens * keep_ratio)))


@dataclass(slots=True)
class PrunedTokens:
    """Kept tokens `[B, k, D]` and their original positions `[B, k]` (ascending)."""

    tokens: torch.Tensor
    index: torch.Tensor
    dropped: int

    @property
    def count(self) -> int:
        return int(self.tokens.shape[1])


def prune_tokens(tokens: torch.Tensor, saliency: torch.Tensor, keep_ratio: float) -> PrunedTokens:
    """Keep the `keep_ratio` most salient tokens of each image, in raster order."""
    if tokens.dim() != 3 or saliency.shape != tokens.shape[:2]:
        raise VisionInputError(
            f"tokens {tuple(tokens.shape)} and saliency {tuple(saliency.shape)} do not match ([B, N, D] and [B, N])"
        )
    b, n, d = tokens.shape
    k = keep_count(n, keep_ratio)
    if k == n:
        idx = torch.arange(n, device=tokens.device).expand(b, n)
        return PrunedTokens(tokens, idx, 0)
    idx = saliency.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    kept = tokens.gather(1, idx.unsqueeze(-1).expand(b, k, d))
    return PrunedTokens(kept, idx, b * (n - k))
