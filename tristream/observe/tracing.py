"""Per-turn traces: one span per user turn with child spans per stage milestone.

Spans are built after the fact from a turn's reference timestamps (so tracing adds nothing
to the hot path) and kept in a bounded in-memory list (`TurnTracer.spans`, for tests and
`tristream top`). When ``otlp_endpoint`` is given and the OpenTelemetry SDK with its OTLP
exporter is installed (optional: ``pip install opentelemetry-sdk
opentelemetry-exporter-otlp-proto-http``), the same spans are exported over OTLP/HTTP; off
by default.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol


class TurnLike(Protocol):
    """What a turn must expose (`tristream.serve.session.TurnTiming` does)."""

    speech_started: int
    speech_stopped: int
    requested: int
    transcript_done: int
    response_started: int
    first_text: int
    first_audio: int
    done: int
    status: str


class TracingUnavailable(Exception):
    """OTLP export was asked for but the OpenTelemetry packages are missing."""


@dataclass(slots=True)
class Span:
    """A finished span on the reference clock (ns)."""

    name: str
    start_ns: int
    end_ns: int
    parent: str | None
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ms(self) -> float:
        """Length in ms."""
        return (self.end_ns - self.start_ns) / 1e6


_STAGES = (
    # name, start milestone, end milestone
    ("user.speech", "speech_started", "speech_stopped"),
    ("asr.final", "speech_stopped", "transcript_done"),
    ("response.first_text", "speech_stopped", "first_text"),
    ("response.first_audio", "speech_stopped", "first_audio"),
    ("response.stream", "response_started", "done"),
)


class TurnTracer:
    """Turns -> spans; keeps the last ``keep`` spans and optionally exports them over OTLP."""

    def __init__(self, keep: int = 4096, otlp_endpoint: str | None = None, exporter: Any = None) -> None:
        self.spans: deque[Span] = deque(maxlen=keep)
        self._wall_offset = time.time_ns() - time.monotonic_ns()
        self._otel: Any = None
        if otlp_endpoint or exporter is not None:
            self._otel = _otel_tracer(otlp_endpoint, exporter)

    def record_turn(self, session_id: str, turn: TurnLike) -> list[Span]:
        """Make the spans of one finished turn (skipping milestones never reached)."""
        start = turn.speech_started or turn.requested or turn.response_started
        if not start or not turn.done:
            return []
        attrs = {"session.id": session_id, "turn.status": turn.status}
        root = Span("turn", start, turn.done, None, attrs)
        made = [root]
        for name, a, b in _STAGES:
            ta, tb = getattr(turn, a), getattr(turn, b)
            if name.startswith("response.first") and not ta:
                ta = turn.requested or turn.response_started
            if ta and tb and tb >= ta:
                made.append(Span(name, ta, tb, "turn", {"session.id": session_id}))
        self.spans.extend(made)
        if self._otel is not None:
            self._export(made)
        return made

    def _export(self, spans: list[Span]) -> None:
        from opentelemetry import trace

        root = spans[0]
        off = self._wall_offset
        parent = self._otel.start_span(root.name, start_time=root.start_ns + off, attributes=root.attributes)
        ctx = trace.set_span_in_context(parent)
        for s in spans[1:]:
            child = self._otel.start_span(s.name, context=ctx, start_time=s.start_ns + off, attributes=s.attributes)
            child.end(end_time=s.end_ns + off)
        parent.end(end_time=root.end_ns + off)


def _otel_tracer(endpoint: str | None, exporter: Any = None) -> Any:
    """An OpenTelemetry tracer exporting to ``exporter`` (tests) or OTLP/HTTP at ``endpoint``."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable("tracing export needs `pip install opentelemetry-sdk "
                                 "opentelemetry-exporter-otlp-proto-http`") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": "tristream"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TracingUnavailable("OTLP export needs `pip install opentelemetry-exporter-otlp-proto-http`") from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider.get_tracer("tristream.serve")
