"""Unit tests of client-event validation (no sockets)."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.serve import protocol as P


def parse(ev: object) -> P.ClientEvent:
    return P.parse_client_event(json.dumps(ev))


def test_audio_append_roundtrip() -> None:
    pcm = bytes(range(0, 200))
    ev = parse({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode(), "event_id": "e1"})
    assert isinstance(ev, P.AudioAppend) and ev.pcm == pcm and ev.event_id == "e1"


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        ("{not json", P.E_INVALID_JSON, None),
        ("[1, 2]", P.E_INVALID_EVENT, None),
        ('{"audio": "AAAA"}', P.E_MISSING_PARAM, "type"),
        ('{"type": "input_audio_buffer.explode"}', P.E_UNKNOWN_EVENT, "type"),
        ('{"type": "input_audio_buffer.append", "audio": "@@@"}', P.E_INVALID_VALUE, "audio"),
        ('{"type": "input_audio_buffer.append", "audio": "AAAA"}', P.E_INVALID_VALUE, "audio"),  # 3 bytes: odd
        ('{"type": "input_audio_buffer.append", "audio": 5}', P.E_INVALID_VALUE, "audio"),
        ('{"type": "input_audio_buffer.append", "audio": "AAAA", "volume": 3}', P.E_UNKNOWN_PARAM, "volume"),
        ('{"type": "session.update", "session": {"voice": 3}}', P.E_INVALID_VALUE, "voice"),
        ('{"type": "session.update", "session": {"bogus": 1}}', P.E_UNKNOWN_PARAM, "session.bogus"),
        ('{"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}}', P.E_INVALID_VALUE,
         "session.input_audio_format"),
        ('{"type": "session.update", "session": {"turn_detection": {"type": "push_to_talk"}}}', P.E_INVALID_VALUE,
         "session.turn_detection.type"),
        ('{"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}',
         P.E_INVALID_VALUE, "session.turn_detection.eagerness"),
        ('{"type": "session.update", "session": {"modalities": ["smell"]}}', P.E_INVALID_VALUE, "session.modalities"),
        ('{"type": "conversation.item.create", "item": {"type": "message", "role": "assistant", '
         '"content": [{"type": "input_text", "text": "x"}]}}', P.E_INVALID_VALUE, "item.role"),
        ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", '
         '"content": [{"type": "input_image", "image_url": "http://x/y.jpg"}]}}', P.E_INVALID_VALUE,
         "item.content[0].image_url"),
        ('{"type": "tristream.input_video_frame.append", "format": "jpeg", "capture_ts_us": 1, "frame": "AAAA"}',
         P.E_INVALID_VALUE, "frame"),
        ('{"type": "tristream.input_video_frame.append", "format": "rgb24", "capture_ts_us": 1, "frame": "AAAA",'
         ' "width": 2, "height": 2}', P.E_INVALID_VALUE, "frame"),
        ('{"type": "tristream.input_video_frame.append", "format": "jpeg", "capture_ts_us": -5, '
         '"frame": "/9gAAA=="}', P.E_INVALID_VALUE, "capture_ts_us"),
    ],
)
def test_invalid_events_have_codes(raw: str, code: str, param: str | None) -> None:
    with pytest.raises(P.ProtocolError) as ei:
        P.parse_client_event(raw)
    assert ei.value.code == code
    if param is not None:
        assert ei.value.param == param


def test_binary_frames_rejected() -> None:
    with pytest.raises(P.ProtocolError) as ei:
        P.parse_client_event(b"\x00\x01")
    assert ei.value.code == P.E_INVALID_EVENT


def test_item_with_text_and_image() -> None:
    jpeg = b"\xff\xd8\xff\xe0" + b"x" * 20
    ev = parse({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()}]}})
    assert isinstance(ev, P.ItemCreate)
    assert ev.texts == ["what is this?"] and ev.images[0].data == jpeg and ev.images[0].mime == "jpeg"


def test_video_frame_raw_ok() -> None:
    ev = parse({"type": P.VIDEO_FRAME_EVENT, "format": "gray8", "width": 4, "height": 2, "capture_ts_us": 123,
                "frame": base64.b64encode(bytes(8)).decode()})
    assert isinstance(ev, P.VideoFrameAppend) and ev.capture_ts_us == 123 and ev.stream_id == "camera"


def test_session_update_turn_detection() -> None:
    ev = parse({"type": "session.update", "session": {"turn_detection": {"type": "server_vad",
                                                                          "silence_duration_ms": 300}}})
    assert isinstance(ev, P.SessionUpdate)
    td = ev.changes["turn_detection"]
    assert isinstance(td, P.TurnDetection) and td.silence_duration_ms == 300 and td.threshold == 0.5
    ev = parse({"type": "session.update", "session": {"turn_detection": None}})
    assert isinstance(ev, P.SessionUpdate) and ev.changes["turn_detection"] is None
    ev = parse({"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad", "eagerness": "low"}}})
    assert isinstance(ev, P.SessionUpdate)
    td = ev.changes["turn_detection"]
    assert (td.type, td.eagerness, td.create_response) == ("semantic_vad", "low", True)
    ev = parse({"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad"}}})
    assert ev.changes["turn_detection"].eagerness == "auto"  # type: ignore[attr-defined]


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=200), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(
        ["type", "audio", "session", "item", "event_id", "frame", "format", "capture_ts_us", "response"]), c,
        max_size=5), max_leaves=20).map(json.dumps)))
def test_fuzz_never_crashes(raw: str) -> None:
    """Any text either parses or raises ProtocolError (never another exception)."""
    try:
        P.parse_client_event(raw)
    except P.ProtocolError as err:
        assert err.code and err.message
