"""Backend factories by name, shared by `tristream serve`, `tristream replay` and the bench.

- ``echo``: `EchoBackend` (no models; protocol tests and serving-layer load).
- ``pipeline``: the assistant pipeline (VAD -> ASR -> LLM -> TTS) through
  `tristream.serve.pipeline_backend`, once the pipeline session exists.
"""

from __future__ import annotations

from tristream.serve.backend import BackendFactory
from tristream.serve.echo import EchoBackend

BACKENDS = ("echo", "pipeline")


class UnknownBackend(Exception):
    """A backend name that is not in `BACKENDS`, or one whose parts are not installed."""


def make_factory(name: str, pace: float = 0.0) -> BackendFactory:
    """A zero-argument callable creating one backend per session."""
    if name == "echo":
        return lambda: EchoBackend(pace=pace)
    if name == "pipeline":
        try:
            from tristream.serve.pipeline_backend import pipeline_factory
        except ImportError as exc:
            raise UnknownBackend(f"backend 'pipeline' is not available: {exc}") from exc
        return pipeline_factory()
    raise UnknownBackend(f"unknown backend {name!r}; choose one of {BACKENDS}")
