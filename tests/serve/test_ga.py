"""GA event names of the OpenAI Realtime API, mirrored per session (`tristream.serve.ga`).

Sockets-free checks of the mapping on a virtual clock, and the official `openai` package's GA
client (`client.realtime.connect`) against the real server on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
import pytest

from tests.serve.helpers import TOKEN, run, running_server, tone_turns
from tristream.observe.events import AnswerAudio, AnswerText, ResponseDone, ResponseStarted
from tristream.serve.echo import EchoBackend
from tristream.serve.replay import VirtualClock
from tristream.serve.session import RealtimeSession


def make() -> tuple[RealtimeSession, list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    s = RealtimeSession("s", EchoBackend(), out.append, VirtualClock(1_000))
    asyncio.run(s.open())
    return s, out


def answer(s: RealtimeSession) -> None:
    for ev in (ResponseStarted(0), AnswerText("hi", 0), AnswerAudio(np.zeros(240, np.int16), 0),
               ResponseDone("completed", 0)):
        s.on_backend_event(ev)


def send(s: RealtimeSession, ev: dict[str, Any]) -> None:
    s.handle_message(json.dumps(ev))


def test_ga_shaped_update_switches_names_and_beta_update_switches_back() -> None:
    s, out = make()
    assert out[0]["type"] == "session.created" and "modalities" in out[0]["session"]  # beta until told
    send(s, {"type": "session.update", "session": {
        "type": "realtime", "output_modalities": ["audio"], "instructions": "short",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 400,
                                               "idle_timeout_ms": None}},
                  "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"}}}})
    upd = out[-1]
    assert upd["type"] == "session.updated"
    sess = upd["session"]
    assert sess["type"] == "realtime" and sess["output_modalities"] == ["audio"]
    assert sess["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 16000}
    assert sess["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 400
    assert s.settings.input_audio_sample_rate == 16000 and s.settings.voice == "alloy"
    del out[:]
    answer(s)
    types = [e["type"] for e in out]
    assert types == ["response.created", "response.output_item.added", "conversation.item.added",
                     "response.output_audio_transcript.delta", "response.output_audio.delta",
                     "response.output_audio.done", "response.output_audio_transcript.done",
                     "response.output_item.done", "conversation.item.done", "response.done"]
    assert out[0]["response"]["output_modalities"] == ["audio"] and "modalities" not in out[0]["response"]
    assert out[-1]["response"]["output"][0]["content"][0]["type"] == "output_audio"
    del out[:]
    send(s, {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": "x"}]}})
    assert [e["type"] for e in out] == ["conversation.item.added", "conversation.item.done"]
    del out[:]
    send(s, {"type": "session.update", "session": {"modalities": ["text"]}})  # beta shape: beta names again
    assert "modalities" in out[-1]["session"]
    del out[:]
    answer(s)
    assert "response.text.delta" in [e["type"] for e in out]


def test_ga_session_update_errors_name_the_ga_path() -> None:
    s, out = make()
    send(s, {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"format": {
        "type": "audio/pcmu"}}}}})
    assert out[-1]["error"]["param"] == "session.audio.input.format"
    send(s, {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"fromat": {}}}}})
    assert out[-1]["error"]["code"] == "unknown_parameter"
    assert out[-1]["error"]["param"] == "session.audio.input.fromat"
    send(s, {"type": "session.update", "session": {"type": "transcription"}})
    assert out[-1]["error"]["param"] == "session.type"
    assert s.settings.api == "beta"  # refused updates change nothing


openai = pytest.importorskip("openai")


def test_openai_ga_realtime_client_text_and_audio() -> None:
    async def go() -> None:
        async with running_server() as srv:
            client = openai.AsyncOpenAI(api_key=TOKEN, websocket_base_url=f"ws://127.0.0.1:{srv.port}/v1")
            async with client.realtime.connect(model="tristream-embedded") as conn:
                assert (await conn.recv()).type == "session.created"
                await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                                   "instructions": "be brief"})
                ev = await conn.recv()
                assert ev.type == "session.updated" and ev.session.output_modalities == ["text"]
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "hi from ga"}]})
                await conn.response.create(response={"output_modalities": ["text"]})
                types, text, done = [], "", None
                async for ev in conn:
                    types.append(ev.type)
                    assert ev.type != "error", ev
                    if ev.type == "response.output_text.delta":
                        text += ev.delta
                    elif ev.type == "response.done":
                        done = ev
                        break
                assert types[:2] == ["conversation.item.added", "conversation.item.done"]
                assert text == "echo: hi from ga"
                assert done is not None and done.response.status == "completed"
                assert done.response.output[0].content[0].type == "output_text"
                assert done.response.output[0].content[0].text == text

                await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"], "audio": {
                    "input": {"format": {"type": "audio/pcm", "rate": 24000},
                              "turn_detection": {"type": "server_vad"}}}})
                pcm = tone_turns([500])
                for k in range(0, pcm.size, 4800):
                    await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[k:k + 4800].tobytes()).decode())
                types, audio_bytes, transcript = [], 0, ""
                async for ev in conn:
                    types.append(ev.type)
                    if ev.type == "response.output_audio.delta":
                        audio_bytes += len(base64.b64decode(ev.delta))
                    elif ev.type == "response.output_audio_transcript.delta":
                        transcript += ev.delta
                    elif ev.type == "response.done":
                        break
                assert "input_audio_buffer.speech_stopped" in types and "conversation.item.added" in types
                assert not any(t in types for t in ("response.audio.delta", "conversation.item.created"))
                assert audio_bytes > 0 and transcript
    run(go())
