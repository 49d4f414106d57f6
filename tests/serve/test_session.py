"""RealtimeSession without sockets: event mapping from backend events, on a virtual clock."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from tristream.observe.events import (
    AnswerAudio,
    AnswerText,
    ResponseDone,
    ResponseStarted,
    SpeechStarted,
    SpeechStopped,
    TranscriptDelta,
    TranscriptDone,
)
from tristream.sched.clock import VirtualClock
from tristream.serve.echo import EchoBackend
from tristream.serve.session import RealtimeSession


def make() -> tuple[RealtimeSession, list[dict[str, Any]], VirtualClock]:
    out: list[dict[str, Any]] = []
    clock = VirtualClock(1_000)
    s = RealtimeSession("s", EchoBackend(), out.append, clock)
    asyncio.run(s.open())
    return s, out, clock


def test_transcript_deltas_are_increments_and_revisions_are_counted() -> None:
    s, out, _ = make()
    for ev in (SpeechStarted(0, 0), TranscriptDelta("turn on", 0), TranscriptDelta("turn on the", 0),
               TranscriptDelta("turn of the", 0), TranscriptDelta("turn of the lights", 0),
               TranscriptDone("turn off the lights", 0)):
        s.on_backend_event(ev)
    deltas = [e["delta"] for e in out if e["type"] == "conversation.item.input_audio_transcription.delta"]
    assert deltas == ["turn on", " the"]
    done = [e for e in out if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert done[0]["transcript"] == "turn off the lights"
    assert s.metrics.count("tristream_transcript_revisions_total") == 2


def test_a_failed_transcription_is_sent_as_the_protocols_failed_event() -> None:
    s, out, _ = make()
    s.on_backend_event(SpeechStarted(0, 0))
    s.on_backend_event(SpeechStopped(900, 0))
    s.on_backend_event(TranscriptDone("", 0, None, "RuntimeError: decoder exploded"))
    failed = [e for e in out if e["type"] == "conversation.item.input_audio_transcription.failed"]
    assert len(failed) == 1 and failed[0]["error"]["message"] == "RuntimeError: decoder exploded"
    assert failed[0]["item_id"]
    assert not [e for e in out if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert s.metrics.count("tristream_transcription_failures_total") == 1


def test_turn_latencies_on_virtual_clock_and_response_done() -> None:
    s, out, clock = make()
    s.on_backend_event(SpeechStarted(100, 0))
    clock.advance_to(2_000_000_000)
    s.on_backend_event(SpeechStopped(900, 0))
    clock.advance_to(2_150_000_000)
    s.on_backend_event(TranscriptDone("hi", 0))
    s.on_backend_event(ResponseStarted(0))
    clock.advance_to(2_400_000_000)
    s.on_backend_event(AnswerText("hello", 0))
    clock.advance_to(2_500_000_000)
    s.on_backend_event(AnswerAudio(np.zeros(240, np.int16), 0))
    clock.advance_to(3_000_000_000)
    s.on_backend_event(ResponseDone("completed", 0))
    done = out[-1]
    assert done["type"] == "response.done" and done["response"]["status"] == "completed"
    lat = done["x_tristream"]["latency_ms"]
    assert lat == {"eos_to_transcript_done_ms": 150.0, "eos_to_first_text_ms": 400.0,
                   "eos_to_first_audio_ms": 500.0, "eos_to_done_ms": 1000.0}
    assert done["response"]["output"][0]["content"][0]["transcript"] == "hello"
    types = [e["type"] for e in out]
    assert types.index("input_audio_buffer.speech_stopped") < types.index("input_audio_buffer.committed")
    assert s.metrics.latencies["tristream_eos_to_first_audio_seconds"].count == 1


def test_events_without_a_response_are_counted_not_sent() -> None:
    s, out, _ = make()
    n = len(out)
    s.on_backend_event(AnswerText("stray", 0))
    s.on_backend_event(ResponseDone("completed", 0))
    assert len(out) == n
    assert s.metrics.count("tristream_events_dropped_total", reason="text_without_response") == 1
    assert s.metrics.count("tristream_events_dropped_total", reason="done_without_response") == 1


# SOI, a 1x1 baseline frame header, EOI: passes the structural check (serve/media.py)
TINY_JPEG = b"\xff\xd8\xff\xc0\x00\x0b\x08\x00\x01\x00\x01\x01\x01\x11\x00\xff\xd9"


def test_backend_failure_becomes_error_event_and_session_goes_on() -> None:
    import base64
    import json

    class Broken(EchoBackend):
        def push_frame(self, frame: object) -> None:
            raise RuntimeError("decoder exploded")

    out: list[dict[str, Any]] = []
    s = RealtimeSession("s", Broken(), out.append, VirtualClock(0))
    asyncio.run(s.open())
    s.handle_message(json.dumps({"type": "tristream.input_video_frame.append", "format": "jpeg", "capture_ts_us": 1,
                                 "frame": base64.b64encode(TINY_JPEG).decode()}))
    err = out[-1]
    assert err["type"] == "error" and err["error"]["code"] == "server_error"
    assert "decoder exploded" in err["error"]["message"]
    s.handle_message(json.dumps({"type": "input_audio_buffer.clear"}))
    assert out[-1]["type"] == "input_audio_buffer.cleared"
    assert s.metrics.count("tristream_messages_dropped_total", reason="backend_error") == 1


def test_a_refused_frame_does_not_move_its_streams_clock() -> None:
    """Only media the backend took advances the stream's capture clock: a frame whose push
    failed must not make the next (earlier-stamped but still in-order) frame 'go backwards'."""
    import base64
    import json

    class FailsOnce(EchoBackend):
        failed = False

        def push_frame(self, frame: object) -> None:
            if not FailsOnce.failed:
                FailsOnce.failed = True
                raise RuntimeError("decoder exploded")
            super().push_frame(frame)  # type: ignore[arg-type]

    def frame(ts: int) -> str:
        return json.dumps({"type": "tristream.input_video_frame.append", "format": "jpeg", "capture_ts_us": ts,
                           "frame": base64.b64encode(TINY_JPEG).decode()})

    out: list[dict[str, Any]] = []
    s = RealtimeSession("s", FailsOnce(), out.append, VirtualClock(0))
    asyncio.run(s.open())
    s.handle_message(frame(1_000_000))  # refused by the backend
    assert out[-1]["type"] == "error" and out[-1]["error"]["code"] == "server_error"
    n = len(out)
    s.handle_message(frame(500))  # in order for what was taken: accepted
    assert len(out) == n, out[n:]
    s.handle_message(frame(400))  # now backwards
    assert out[-1]["type"] == "error" and out[-1]["error"]["code"] == "invalid_value"
