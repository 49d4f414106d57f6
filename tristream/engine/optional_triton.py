"""Triton where it is installed, else None for both names: CPU-only installs keep the torch paths
of the modules that import it from here (each says so with its own `available()`)."""

from __future__ import annotations

from typing import Any


def _load() -> tuple[Any, Any]:
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - exercised on CPU-only machines
        return None, None
    return triton, tl


triton, tl = _load()
