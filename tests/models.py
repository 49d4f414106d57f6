"""Models in tests: real ones loaded, or the test skipped with the reason when one is not installed;
tiny ones given seeded random weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import pytest

from tristream.stages.base import ModelUnavailable

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
M = TypeVar("M", bound="torch.nn.Module")


def load_or_skip(load: Callable[[], T]) -> T:
    """`load()`; a `ModelUnavailable` it raises skips the test with its message."""
    try:
        return load()
    except ModelUnavailable as e:
        pytest.skip(str(e))


def randomise(model: M, seed: int, scale: float) -> M:
    """Every parameter of `model` set to seeded normal noise times `scale`, in place; returns `model`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model
