"""The wire protocol: a documented subset of the OpenAI Realtime API (beta ``realtime=v1`` names; GA in `ga`).

Client events are parsed into small typed dataclasses with strict validation; every
violation raises :class:`ProtocolError` carrying an OpenAI-style error ``code`` and the
offending ``param``, which the session turns into an ``error`` event (the session goes
on). Server events are built by plain functions returning JSON-ready dicts, so that
the official ``openai`` client parses them. The video extension event
``tristream.input_video_frame.append`` carries one timestamped camera frame.
See ``docs/protocol.md`` for the human-readable description.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import secrets
from dataclasses import dataclass
from typing import Any

from tristream.serve.media import MediaError, jpeg_size
from tristream.serve.settings import DEFAULT_SAMPLE_RATE, SessionSettings, TurnDetection

__all__ = ["DEFAULT_SAMPLE_RATE", "ProtocolError", "SessionSettings", "TurnDetection", "parse_client_event",
           "server_event"]

# Error codes (the `error.code` field). Stable: clients may switch on them.
E_INVALID_JSON = "invalid_json"
E_INVALID_EVENT = "invalid_event"
E_UNKNOWN_EVENT = "unknown_event_type"
E_UNKNOWN_PARAM = "unknown_parameter"
E_MISSING_PARAM = "missing_required_parameter"
E_INVALID_VALUE = "invalid_value"
E_TOO_LARGE = "message_too_large"
E_RATE_LIMITED = "rate_limit_exceeded"
E_EMPTY_BUFFER = "input_audio_buffer_commit_empty"
E_NO_ACTIVE_RESPONSE = "response_cancel_not_active"
E_RESPONSE_ACTIVE = "conversation_already_has_active_response"
E_SESSION_EXPIRED = "session_expired"
E_SLOW_CLIENT = "slow_client"
E_SERVER_ERROR = "server_error"
E_SHUTTING_DOWN = "server_shutting_down"
E_SHED = "scheduler_shed"
E_TIER_NOT_ALLOWED = "tier_not_allowed"

MAX_TS_US = 1 << 62  # capture timestamps beyond this overflow int64 nanoseconds downstream
SUPPORTED_SAMPLE_RATES = (8_000, 16_000, 24_000, 48_000)
VIDEO_FORMATS = ("jpeg", "rgb24", "gray8")
VIDEO_FRAME_EVENT = "tristream.input_video_frame.append"
TIER_NAMES = ("gold", "silver", "bronze")
"""SLA tiers, most important first (the scheduler's `Tier` order)."""


class ProtocolError(Exception):
    """A client event that breaks the protocol; becomes an ``error`` event, never a disconnect."""

    def __init__(self, code: str, message: str, param: str | None = None, event_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        self.error_type = "invalid_request_error"


# ---------------------------------------------------------------- client events


@dataclass(slots=True)
class SessionUpdate:
    """``session.update``: only the given keys change."""

    event_id: str | None
    changes: dict[str, Any]
    api: str | None = None
    """``"ga"`` / ``"beta"`` when the body's shape says which API the client speaks (`serve.ga`)."""


@dataclass(slots=True)
class AudioAppend:
    """``input_audio_buffer.append``: little-endian int16 mono PCM bytes."""

    event_id: str | None
    pcm: bytes
    capture_ts_us: int | None = None


@dataclass(slots=True)
class AudioCommit:
    """``input_audio_buffer.commit``: end the user's turn by hand (needed when turn_detection is null)."""

    event_id: str | None


@dataclass(slots=True)
class AudioClear:
    """``input_audio_buffer.clear``: drop uncommitted audio."""

    event_id: str | None


@dataclass(slots=True)
class ImageInput:
    """One ``input_image`` content part, decoded."""

    data: bytes
    mime: str


@dataclass(slots=True)
class ItemCreate:
    """``conversation.item.create`` with a user/system message of text and/or images."""

    event_id: str | None
    item_id: str | None
    role: str
    texts: list[str]
    images: list[ImageInput]


@dataclass(slots=True)
class ResponseCreate:
    """``response.create``: ask for an answer now."""

    event_id: str | None
    instructions: str | None
    modalities: list[str] | None
    tool_choice: Any = None
    """This answer's ``tool_choice`` (raw; None: the session's), checked by the session."""
    metadata: dict[str, str] | None = None
    """The client's key/value pairs, echoed in the answer's ``response.created`` / ``response.done``."""


@dataclass(slots=True)
class ResponseCancel:
    """``response.cancel``: stop the answer in progress (barge-in from the client side)."""

    event_id: str | None
    response_id: str | None


@dataclass(slots=True)
class ItemTruncate:
    """``conversation.item.truncate``: the client played only the first ``audio_end_ms`` of an
    assistant item's audio (the user spoke over it); the server forgets the rest."""

    event_id: str | None
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass(slots=True)
class VideoFrameAppend:
    """Extension ``tristream.input_video_frame.append``: one camera frame with its capture time."""

    event_id: str | None
    data: bytes
    format: str
    capture_ts_us: int
    width: int | None
    height: int | None
    stream_id: str


@dataclass(slots=True)
class FunctionOutputCreate:
    """``conversation.item.create`` of a ``function_call_output``: a function's result for a call."""

    event_id: str | None
    item_id: str | None
    call_id: str
    output: str


@dataclass(slots=True)
class FunctionCallCreate:
    """``conversation.item.create`` of a ``function_call`` the client adds to the conversation."""

    event_id: str | None
    item_id: str | None
    call_id: str
    name: str
    arguments: str


ClientEvent = (
    SessionUpdate
    | FunctionOutputCreate
    | FunctionCallCreate
    | AudioAppend
    | AudioCommit
    | AudioClear
    | ItemCreate
    | ResponseCreate
    | ResponseCancel
    | ItemTruncate
    | VideoFrameAppend
)

_SESSION_KEYS = {
    "modalities", "instructions", "voice", "input_audio_format", "output_audio_format",
    "input_audio_sample_rate", "output_audio_sample_rate", "input_audio_transcription",
    "turn_detection", "temperature", "max_response_output_tokens", "tier",
    "tools", "tool_choice",
    # Accepted for compatibility with official clients, ignored (documented):
    "model", "input_audio_noise_reduction", "tracing", "speed",
    "client_secret", "include",
}
_TURN_KEYS = {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
              "interrupt_response", "eagerness", "idle_timeout_ms"}
_IMAGE_MIMES = {"image/jpeg": "jpeg", "image/png": "png"}


def _require(obj: dict[str, Any], key: str, typ: type | tuple[type, ...], eid: str | None) -> Any:
    if key not in obj:
        raise ProtocolError(E_MISSING_PARAM, f"missing required parameter '{key}'", key, eid)
    val = obj[key]
    if not isinstance(val, typ) or (isinstance(val, bool) and typ is int):
        raise ProtocolError(E_INVALID_VALUE, f"'{key}' must be {_tname(typ)}, got {type(val).__name__}", key, eid)
    return val


def _optional(obj: dict[str, Any], key: str, typ: type | tuple[type, ...], eid: str | None) -> Any:
    if obj.get(key) is None:
        return None
    return _require(obj, key, typ, eid)


def _tname(typ: type | tuple[type, ...]) -> str:
    if isinstance(typ, tuple):
        return " or ".join(t.__name__ for t in typ)
    return typ.__name__


def _no_extra(obj: dict[str, Any], allowed: set[str], where: str, eid: str | None) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise ProtocolError(E_UNKNOWN_PARAM, f"unknown parameter '{where}{extra[0]}'", f"{where}{extra[0]}", eid)


def _b64(value: str, param: str, eid: str | None) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(E_INVALID_VALUE, f"'{param}' is not valid base64: {exc}", param, eid) from exc


def validate_session_changes(sess: dict[str, Any], eid: str | None) -> dict[str, Any]:
    """Check a ``session.update`` body; return the normalised changes."""
    _no_extra(sess, _SESSION_KEYS, "session.", eid)
    out: dict[str, Any] = {}
    if "modalities" in sess:
        mods = _require(sess, "modalities", list, eid)
        if not mods or any(m not in ("text", "audio") for m in mods):
            raise ProtocolError(E_INVALID_VALUE, "session.modalities must be a non-empty subset of ['text', 'audio']",
                                "session.modalities", eid)
        out["modalities"] = list(dict.fromkeys(mods))
    for key in ("instructions", "voice"):
        if key in sess:
            out[key] = _require(sess, key, str, eid)
    for key in ("input_audio_format", "output_audio_format"):
        if key in sess:
            fmt = _require(sess, key, str, eid)
            if fmt != "pcm16":
                raise ProtocolError(E_INVALID_VALUE, f"session.{key} '{fmt}' is not supported; use 'pcm16'",
                                    f"session.{key}", eid)
            out[key] = fmt
    for key in ("input_audio_sample_rate", "output_audio_sample_rate"):
        if key in sess:
            rate = _require(sess, key, int, eid)
            if rate not in SUPPORTED_SAMPLE_RATES:
                raise ProtocolError(E_INVALID_VALUE, f"session.{key} must be one of {SUPPORTED_SAMPLE_RATES}",
                                    f"session.{key}", eid)
            out[key] = rate
    if "tier" in sess:
        tier = _require(sess, "tier", str, eid)
        if tier not in TIER_NAMES:
            raise ProtocolError(E_INVALID_VALUE, f"session.tier must be one of {TIER_NAMES}", "session.tier", eid)
        out["tier"] = tier
    if "tools" in sess:
        from tristream.serve.tools import ToolSpecError, parse_tools

        try:
            out["tools"] = parse_tools(sess["tools"] if sess["tools"] is not None else [], "session.tools")
        except ToolSpecError as e:
            raise ProtocolError(E_INVALID_VALUE, str(e), e.param, eid) from None
    if "tool_choice" in sess:
        out["tool_choice"] = sess["tool_choice"]  # checked against the tools by the session
    if "input_audio_transcription" in sess:
        out["input_audio_transcription"] = _optional(sess, "input_audio_transcription", dict, eid)
    if "temperature" in sess:
        out["temperature"] = float(_require(sess, "temperature", (int, float), eid))
    if "max_response_output_tokens" in sess:
        mrt = sess["max_response_output_tokens"]
        if not (mrt == "inf" or (isinstance(mrt, int) and not isinstance(mrt, bool) and 1 <= mrt <= 4096)):
            raise ProtocolError(E_INVALID_VALUE, "max_response_output_tokens must be 1..4096 or 'inf'",
                                "session.max_response_output_tokens", eid)
        out["max_response_output_tokens"] = mrt
    if "turn_detection" in sess:
        td = sess["turn_detection"]
        if td is None:
            out["turn_detection"] = None
        else:
            if not isinstance(td, dict):
                raise ProtocolError(E_INVALID_VALUE, "session.turn_detection must be an object or null",
                                    "session.turn_detection", eid)
            _no_extra(td, _TURN_KEYS, "session.turn_detection.", eid)
            kind = td.get("type", "server_vad")
            if kind not in ("server_vad", "semantic_vad"):
                raise ProtocolError(E_INVALID_VALUE, f"turn_detection.type {kind!r} is not supported: "
                                    "use 'server_vad' or 'semantic_vad'", "session.turn_detection.type", eid)
            t = TurnDetection(type=kind)
            if kind == "semantic_vad" and "eagerness" in td:
                eager = td["eagerness"]
                if eager not in ("low", "medium", "high", "auto"):
                    raise ProtocolError(E_INVALID_VALUE, f"turn_detection.eagerness {eager!r}: expected "
                                        "'low', 'medium', 'high' or 'auto'", "session.turn_detection.eagerness", eid)
                t.eagerness = eager
            if "threshold" in td:
                t.threshold = float(_require(td, "threshold", (int, float), eid))
                if not 0.0 <= t.threshold <= 1.0:
                    raise ProtocolError(E_INVALID_VALUE, "turn_detection.threshold must be in [0, 1]",
                                        "session.turn_detection.threshold", eid)
            for key in ("prefix_padding_ms", "silence_duration_ms"):
                if key in td:
                    v = _require(td, key, int, eid)
                    if not 0 <= v <= 10_000:
                        raise ProtocolError(E_INVALID_VALUE, f"turn_detection.{key} must be 0..10000",
                                            f"session.turn_detection.{key}", eid)
                    setattr(t, key, v)
            for key in ("create_response", "interrupt_response"):
                if key in td:
                    setattr(t, key, _require(td, key, bool, eid))
            out["turn_detection"] = t
    return out


def _parse_function_item(item: dict[str, Any], eid: str | None) -> FunctionOutputCreate | FunctionCallCreate:
    iid = _optional(item, "id", str, eid)
    if item["type"] == "function_call_output":
        _no_extra(item, {"id", "type", "object", "call_id", "output", "status"}, "item.", eid)
        return FunctionOutputCreate(eid, iid, _require(item, "call_id", str, eid), _require(item, "output", str, eid))
    _no_extra(item, {"id", "type", "object", "call_id", "name", "arguments", "status"}, "item.", eid)
    from tristream.serve.tools import ToolSpecError, check_arguments

    args = _require(item, "arguments", str, eid)
    try:
        check_arguments(args, "item.arguments")
    except ToolSpecError as e:
        raise ProtocolError(E_INVALID_VALUE, str(e), e.param, eid) from None
    return FunctionCallCreate(eid, iid, _require(item, "call_id", str, eid), _require(item, "name", str, eid), args)


def _parse_item(ev: dict[str, Any], eid: str | None) -> ItemCreate | FunctionOutputCreate | FunctionCallCreate:
    _no_extra(ev, {"type", "event_id", "previous_item_id", "item"}, "", eid)
    item = _require(ev, "item", dict, eid)
    if item.get("type") in ("function_call_output", "function_call"):
        return _parse_function_item(item, eid)
    _no_extra(item, {"id", "type", "object", "role", "content", "status"}, "item.", eid)
    if item.get("type", "message") != "message":
        raise ProtocolError(E_INVALID_VALUE, "item.type must be 'message', 'function_call' or "
                            "'function_call_output'", "item.type", eid)
    role = _require(item, "role", str, eid)
    if role not in ("user", "system"):
        raise ProtocolError(E_INVALID_VALUE, "item.role must be 'user' or 'system'", "item.role", eid)
    content = _require(item, "content", list, eid)
    if not content:
        raise ProtocolError(E_INVALID_VALUE, "item.content must not be empty", "item.content", eid)
    texts: list[str] = []
    images: list[ImageInput] = []
    for i, part in enumerate(content):
        p = f"item.content[{i}]"
        if not isinstance(part, dict):
            raise ProtocolError(E_INVALID_VALUE, f"{p} must be an object", p, eid)
        ptype = part.get("type")
        if ptype == "input_text":
            _no_extra(part, {"type", "text"}, p + ".", eid)
            texts.append(_require(part, "text", str, eid))
        elif ptype == "input_image" and role == "user":
            _no_extra(part, {"type", "image_url", "detail"}, p + ".", eid)
            url = _require(part, "image_url", str, eid)
            head, sep, payload = url.partition(",")
            mime = head[5:].split(";")[0] if head.startswith("data:") else ""
            if not sep or not head.endswith(";base64") or mime not in _IMAGE_MIMES:
                raise ProtocolError(E_INVALID_VALUE, f"{p}.image_url must be a data URL "
                                    "'data:image/jpeg;base64,...' or 'data:image/png;base64,...'",
                                    p + ".image_url", eid)
            images.append(ImageInput(_b64(payload, p + ".image_url", eid), _IMAGE_MIMES[mime]))
        else:
            raise ProtocolError(E_INVALID_VALUE, f"{p}.type '{ptype}' is not supported for role '{role}' "
                                "(use 'input_text', or 'input_image' for user)", p + ".type", eid)
    return ItemCreate(eid, _optional(item, "id", str, eid), role, texts, images)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_client_event(raw: str | bytes) -> ClientEvent:
    """Parse and validate one client message; raises :class:`ProtocolError` on any violation."""
    if isinstance(raw, bytes):
        raise ProtocolError(E_INVALID_EVENT, "binary frames are not part of the protocol; send JSON text frames")
    try:
        ev = json.loads(raw, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ProtocolError(E_INVALID_JSON, f"message is not valid JSON: {exc.msg} at char {exc.pos}") from exc
    except ValueError as exc:  # NaN / Infinity (not JSON), or an integer too long to convert
        raise ProtocolError(E_INVALID_JSON, f"message is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ProtocolError(E_INVALID_JSON, "message is not valid JSON: nested too deeply") from exc
    if not isinstance(ev, dict):
        raise ProtocolError(E_INVALID_EVENT, "message must be a JSON object with a 'type' field")
    eid = ev.get("event_id") if isinstance(ev.get("event_id"), str) else None
    etype = _require(ev, "type", str, eid)
    if etype == "session.update":
        _no_extra(ev, {"type", "event_id", "session"}, "", eid)
        from tristream.serve.ga import API_GA, ga_session_changes, session_api

        sess = _require(ev, "session", dict, eid)
        api = session_api(sess)
        body = ga_session_changes(sess, eid) if api == API_GA else sess
        return SessionUpdate(eid, validate_session_changes(body, eid), api)
    if etype == "input_audio_buffer.append":
        _no_extra(ev, {"type", "event_id", "audio", "capture_ts_us"}, "", eid)
        pcm = _b64(_require(ev, "audio", str, eid), "audio", eid)
        if not pcm:
            raise ProtocolError(E_INVALID_VALUE, "audio is empty; send at least one pcm16 sample", "audio", eid)
        if len(pcm) % 2:
            raise ProtocolError(E_INVALID_VALUE, f"audio has {len(pcm)} bytes; pcm16 needs an even count",
                                "audio", eid)
        ats = _optional(ev, "capture_ts_us", int, eid)
        if ats is not None and not 0 <= ats <= MAX_TS_US:
            raise ProtocolError(E_INVALID_VALUE, f"capture_ts_us must be in 0..{MAX_TS_US}", "capture_ts_us", eid)
        return AudioAppend(eid, pcm, ats)
    if etype == "input_audio_buffer.commit":
        _no_extra(ev, {"type", "event_id"}, "", eid)
        return AudioCommit(eid)
    if etype == "input_audio_buffer.clear":
        _no_extra(ev, {"type", "event_id"}, "", eid)
        return AudioClear(eid)
    if etype == "conversation.item.create":
        return _parse_item(ev, eid)
    if etype == "response.create":
        _no_extra(ev, {"type", "event_id", "response"}, "", eid)
        resp = _optional(ev, "response", dict, eid) or {}
        allowed = {"instructions", "modalities", "voice", "output_audio_format", "temperature",
                   "max_response_output_tokens", "conversation", "metadata",
                   # GA names (serve.ga), accepted like their beta twins
                   "output_modalities", "audio", "max_output_tokens", "tools", "tool_choice", "prompt"}
        _no_extra(resp, allowed, "response.", eid)
        from tristream.serve.ga import ga_response_modalities

        mods = _optional(resp, "modalities", list, eid) or ga_response_modalities(resp, eid)
        if mods is not None and (not mods or any(m not in ("text", "audio") for m in mods)):
            raise ProtocolError(E_INVALID_VALUE, "response.modalities must be a non-empty subset of "
                                "['text', 'audio']", "response.modalities", eid)
        if resp.get("tools") is not None:
            raise ProtocolError(E_INVALID_VALUE, "response.tools is not supported; set the tools with "
                                "session.update (response.tool_choice may pick one of them)", "response.tools", eid)
        meta = _optional(resp, "metadata", dict, eid)
        if meta is not None and (len(meta) > 16 or any(not isinstance(k, str) or not isinstance(v, str)
                                                       or len(k) > 64 or len(v) > 512 for k, v in meta.items())):
            raise ProtocolError(E_INVALID_VALUE, "response.metadata must map at most 16 string keys (64 chars) "
                                "to string values (512 chars)", "response.metadata", eid)
        return ResponseCreate(eid, _optional(resp, "instructions", str, eid), mods, resp.get("tool_choice"), meta)
    if etype == "response.cancel":
        _no_extra(ev, {"type", "event_id", "response_id"}, "", eid)
        return ResponseCancel(eid, _optional(ev, "response_id", str, eid))
    if etype == "conversation.item.truncate":
        _no_extra(ev, {"type", "event_id", "item_id", "content_index", "audio_end_ms"}, "", eid)
        item_id = _require(ev, "item_id", str, eid)
        index = _require(ev, "content_index", int, eid)
        end_ms = _require(ev, "audio_end_ms", int, eid)
        if index < 0 or end_ms < 0:
            raise ProtocolError(E_INVALID_VALUE, "content_index and audio_end_ms must be >= 0",
                                "content_index" if index < 0 else "audio_end_ms", eid)
        return ItemTruncate(eid, item_id, index, end_ms)
    if etype == VIDEO_FRAME_EVENT:
        _no_extra(ev, {"type", "event_id", "frame", "format", "capture_ts_us", "width", "height", "stream_id"},
                  "", eid)
        fmt = _require(ev, "format", str, eid)
        if fmt not in VIDEO_FORMATS:
            raise ProtocolError(E_INVALID_VALUE, f"format must be one of {VIDEO_FORMATS}", "format", eid)
        data = _b64(_require(ev, "frame", str, eid), "frame", eid)
        ts = _require(ev, "capture_ts_us", int, eid)
        if not 0 <= ts <= MAX_TS_US:
            raise ProtocolError(E_INVALID_VALUE, f"capture_ts_us must be in 0..{MAX_TS_US}", "capture_ts_us", eid)
        w = _optional(ev, "width", int, eid)
        h = _optional(ev, "height", int, eid)
        if fmt != "jpeg":
            if w is None or h is None or w <= 0 or h <= 0:
                raise ProtocolError(E_MISSING_PARAM, f"raw format '{fmt}' needs positive width and height",
                                    "width", eid)
            need = w * h * (3 if fmt == "rgb24" else 1)
            if len(data) != need:
                raise ProtocolError(E_INVALID_VALUE, f"frame has {len(data)} bytes; {fmt} {w}x{h} needs {need}",
                                    "frame", eid)
        else:
            try:
                size = jpeg_size(data)
            except MediaError as exc:
                raise ProtocolError(E_INVALID_VALUE, f"frame: {exc}", "frame", eid) from exc
            jw, jh = size if size is not None else (w, h)
            if (w is not None and w != jw) or (h is not None and h != jh):
                raise ProtocolError(E_INVALID_VALUE, f"width/height {w}x{h} do not match the JPEG's {jw}x{jh}",
                                    "width", eid)
        return VideoFrameAppend(eid, data, fmt, ts, w, h, _optional(ev, "stream_id", str, eid) or "camera")
    raise ProtocolError(E_UNKNOWN_EVENT, f"unknown or unsupported event type '{etype}'", "type", eid)


# ---------------------------------------------------------------- server events

_counter = itertools.count(1)


def new_id(prefix: str) -> str:
    """Process-unique ids in OpenAI's style (``event_…``, ``item_…``, ``resp_…``).

    Session ids (``sess_…``) name recordings and metrics series, so they are unguessable
    (128 random bits) rather than a counter another client could enumerate.
    """
    if prefix == "sess":
        return f"sess_{secrets.token_hex(16)}"
    return f"{prefix}_{next(_counter):08d}"


def server_event(etype: str, **fields: Any) -> dict[str, Any]:
    """One server event as a dict with a fresh ``event_id``."""
    return {"type": etype, "event_id": new_id("event"), **fields}


def error_event(err: ProtocolError) -> dict[str, Any]:
    """An ``error`` event for a rejected client message."""
    return server_event("error", error={"type": err.error_type, "code": err.code, "message": err.message,
                                        "param": err.param, "event_id": err.event_id})


def response_object(resp_id: str, status: str, output: list[dict[str, Any]],
                    modalities: list[str], metadata: dict[str, str] | None = None,
                    cancel_reason: str = "client_cancelled") -> dict[str, Any]:
    """The ``response`` object of ``response.created`` / ``response.done``; ``metadata``: the client's
    from ``response.create`` (None there); ``cancel_reason``: ``client_cancelled`` (``response.cancel``)
    or ``turn_detected`` (the server's turn detection cut it: the user spoke)."""
    obj: dict[str, Any] = {"id": resp_id, "object": "realtime.response", "status": status,
                           "status_details": None, "output": output, "modalities": modalities,
                           "output_audio_format": "pcm16", "usage": None, "metadata": metadata}
    if status == "cancelled":
        obj["status_details"] = {"type": "cancelled", "reason": cancel_reason}
    return obj


def dumps(event: dict[str, Any]) -> str:
    """Serialise a server event compactly."""
    return json.dumps(event, separators=(",", ":"))
