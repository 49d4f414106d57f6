"""The GA (general availability) shape of the OpenAI Realtime API, next to the beta one.

OpenAI renamed events and reshaped the session object when the Realtime API left beta
(``response.text.delta`` became ``response.output_text.delta``, ``conversation.item.created``
became ``conversation.item.added`` + ``conversation.item.done``, the session's audio settings
moved under ``session.audio``). The server speaks both, chosen per session by mirroring the
client: a ``session.update`` in the GA shape (``session.type: "realtime"``, or GA-only
fields such as ``output_modalities`` / ``audio``) switches the session to GA names, one in
the beta shape switches it back; a session starts in beta names (``session.created`` is sent
before the client has said anything).

Internally everything stays beta-shaped: `ga_session_changes` turns a GA ``session`` body into
beta keys for the one validator, and `to_ga` rewrites each outgoing server event.
"""

from __future__ import annotations

from typing import Any

from tristream.serve import protocol as P

API_BETA = "beta"
API_GA = "ga"

GA_SESSION_MARKERS = frozenset({"type", "output_modalities", "audio", "max_output_tokens", "truncation", "prompt"})
BETA_SESSION_MARKERS = frozenset({"modalities", "input_audio_format", "output_audio_format", "turn_detection",
                                  "input_audio_transcription", "max_response_output_tokens",
                                  "input_audio_noise_reduction"})
_GA_SESSION_KEYS = {"type", "output_modalities", "audio", "instructions", "max_output_tokens", "model", "tools",
                    "tool_choice", "tracing", "truncation", "prompt", "include", "temperature", "client_secret",
                    "expires_at", "id", "object", "tier"}
_RENAMED = {
    "response.text.delta": "response.output_text.delta",
    "response.text.done": "response.output_text.done",
    "response.audio.delta": "response.output_audio.delta",
    "response.audio.done": "response.output_audio.done",
    "response.audio_transcript.delta": "response.output_audio_transcript.delta",
    "response.audio_transcript.done": "response.output_audio_transcript.done",
}
_CONTENT = {"audio": "output_audio", "text": "output_text"}


def session_api(sess: dict[str, Any]) -> str | None:
    """Which shape a ``session.update`` body uses: ``"ga"``, ``"beta"`` or None (no telling fields)."""
    if GA_SESSION_MARKERS & sess.keys():
        return API_GA
    if BETA_SESSION_MARKERS & sess.keys():
        return API_BETA
    return None


def _obj(d: dict[str, Any], key: str, path: str, eid: str | None, allowed: set[str]) -> dict[str, Any]:
    val = d.get(key)
    if val is None:
        return {}
    if not isinstance(val, dict):
        raise P.ProtocolError(P.E_INVALID_VALUE, f"{path} must be an object", path, eid)
    extra = sorted(set(val) - allowed)
    if extra:
        raise P.ProtocolError(P.E_UNKNOWN_PARAM, f"unknown parameter '{path}.{extra[0]}'", f"{path}.{extra[0]}", eid)
    return val


def _format(fmt: Any, path: str, eid: str | None) -> tuple[str, int | None]:
    if not isinstance(fmt, dict) or fmt.get("type") != "audio/pcm":
        raise P.ProtocolError(P.E_INVALID_VALUE, f"{path} must be {{'type': 'audio/pcm', 'rate': 24000}} "
                              "(g711 formats are not supported)", path, eid)
    extra = sorted(set(fmt) - {"type", "rate"})
    if extra:
        raise P.ProtocolError(P.E_UNKNOWN_PARAM, f"unknown parameter '{path}.{extra[0]}'", f"{path}.{extra[0]}", eid)
    return "pcm16", fmt.get("rate")


def ga_session_changes(sess: dict[str, Any], eid: str | None) -> dict[str, Any]:
    """A GA ``session`` body as the beta keys `validate_session_changes` checks."""
    extra = sorted(set(sess) - _GA_SESSION_KEYS)
    if extra:
        raise P.ProtocolError(P.E_UNKNOWN_PARAM, f"unknown parameter 'session.{extra[0]}' in a GA-shaped "
                              "session.update (audio settings go under session.audio)", f"session.{extra[0]}", eid)
    if sess.get("type", "realtime") != "realtime":
        raise P.ProtocolError(P.E_INVALID_VALUE, "session.type must be 'realtime' (transcription sessions are "
                              "not supported)", "session.type", eid)
    out: dict[str, Any] = {k: sess[k] for k in ("instructions", "model", "tools", "tool_choice", "tracing",
                                                  "include", "temperature", "tier") if k in sess}
    if "output_modalities" in sess:
        mods = sess["output_modalities"]
        if not isinstance(mods, list) or not mods or any(m not in ("text", "audio") for m in mods):
            raise P.ProtocolError(P.E_INVALID_VALUE, "session.output_modalities must be ['text'] or ['audio']",
                                  "session.output_modalities", eid)
        out["modalities"] = ["text", "audio"] if "audio" in mods else ["text"]
    if "max_output_tokens" in sess:
        out["max_response_output_tokens"] = sess["max_output_tokens"]
    audio = _obj(sess, "audio", "session.audio", eid, {"input", "output"})
    inp = _obj(audio, "input", "session.audio.input", eid, {"format", "transcription", "turn_detection",
                                                              "noise_reduction"})
    outp = _obj(audio, "output", "session.audio.output", eid, {"format", "voice", "speed"})
    if "format" in inp:
        out["input_audio_format"], rate = _format(inp["format"], "session.audio.input.format", eid)
        if rate is not None:
            out["input_audio_sample_rate"] = rate
    if "format" in outp:
        out["output_audio_format"], rate = _format(outp["format"], "session.audio.output.format", eid)
        if rate is not None:
            out["output_audio_sample_rate"] = rate
    if "turn_detection" in inp:
        out["turn_detection"] = inp["turn_detection"]
    if "transcription" in inp:
        out["input_audio_transcription"] = inp["transcription"]
    if "noise_reduction" in inp:
        out["input_audio_noise_reduction"] = inp["noise_reduction"]
    if "voice" in outp:
        out["voice"] = outp["voice"]
    if "speed" in outp:
        out["speed"] = outp["speed"]
    return out


def ga_response_modalities(resp: dict[str, Any], eid: str | None) -> list[str] | None:
    """``response.output_modalities`` of a GA ``response.create`` as beta modalities."""
    mods = resp.get("output_modalities")
    if mods is None:
        return None
    if not isinstance(mods, list) or not mods or any(m not in ("text", "audio") for m in mods):
        raise P.ProtocolError(P.E_INVALID_VALUE, "response.output_modalities must be ['text'] or ['audio']",
                              "response.output_modalities", eid)
    return ["text", "audio"] if "audio" in mods else ["text"]


def ga_session(beta: dict[str, Any]) -> dict[str, Any]:
    """The GA ``session`` object for a beta one (`SessionSettings.to_json`)."""
    rate_in, rate_out = beta["input_audio_sample_rate"], beta["output_audio_sample_rate"]
    return {
        "type": "realtime", "object": "realtime.session", "id": beta["id"], "model": beta["model"],
        "output_modalities": ["audio"] if "audio" in beta["modalities"] else ["text"],
        "instructions": beta["instructions"],
        "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": rate_in},
                      "transcription": beta["input_audio_transcription"],
                      "turn_detection": beta["turn_detection"], "noise_reduction": None},
            "output": {"format": {"type": "audio/pcm", "rate": rate_out}, "voice": beta["voice"], "speed": 1.0},
        },
        "tools": beta["tools"], "tool_choice": beta["tool_choice"], "max_output_tokens": beta["max_response_output_tokens"],
        "tracing": None, "truncation": "auto", "prompt": None, "include": None, "tier": beta.get("tier"),
    }


def _item(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("role") != "assistant":
        return item
    content = [{**c, "type": _CONTENT.get(c.get("type", ""), c.get("type"))} for c in item.get("content", [])]
    return {**item, "content": content}


def _response(resp: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in resp.items() if k != "modalities"}
    out["output_modalities"] = ["audio"] if "audio" in resp.get("modalities", []) else ["text"]
    out["output"] = [_item(i) for i in resp.get("output", [])]
    return out


def to_ga(event: dict[str, Any]) -> list[dict[str, Any]]:
    """One beta-shaped server event as the GA event(s) a GA client expects."""
    t = event["type"]
    if t in _RENAMED:
        return [{**event, "type": _RENAMED[t]}]
    if t in ("session.created", "session.updated"):
        return [{**event, "session": ga_session(event["session"])}]
    if t == "conversation.item.created":  # user items are complete when added
        return [{**event, "type": "conversation.item.added"},
                P.server_event("conversation.item.done", previous_item_id=event.get("previous_item_id"),
                               item=event["item"])]
    if t in ("response.created", "response.done"):
        return [{**event, "response": _response(event["response"])}]
    if t == "response.output_item.added":
        item = _item(event["item"])
        return [{**event, "item": item}, P.server_event("conversation.item.added", item=item)]
    if t == "response.output_item.done":
        item = _item(event["item"])
        return [{**event, "item": item}, P.server_event("conversation.item.done", item=item)]
    return [event]
