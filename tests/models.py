"""Real models in tests: loaded, or the test skipped with the reason when one is not installed."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

from tristream.stages.base import ModelUnavailable

T = TypeVar("T")


def load_or_skip(load: Callable[[], T]) -> T:
    """`load()`; a `ModelUnavailable` it raises skips the test with its message."""
    try:
        return load()
    except ModelUnavailable as e:
        pytest.skip(str(e))
