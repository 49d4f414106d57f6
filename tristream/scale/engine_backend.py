"""The unscheduled engine backend under the name Ray deployments and `bench/scale.py` use:
``backend="tristream.scale.engine_backend:engine_factory"`` (`tristream.serve.unscheduled`)."""

from __future__ import annotations

from tristream.serve.unscheduled import EngineTextBackend, engine_factory

__all__ = ["EngineTextBackend", "engine_factory"]
