"""Turn control and images with the real pipeline behind the real server (loopback).

- ``turn_detection: null``: no server VAD events; ``input_audio_buffer.clear`` drops the
  buffered audio; ``input_audio_buffer.commit`` ends the turn (transcribed by Whisper); the
  answer waits for ``response.create`` (OpenAI's manual mode).
- ``create_response: false`` with server VAD: the turn ends by the VAD and is transcribed,
  but no answer starts until ``response.create``.
- ``input_image`` in ``conversation.item.create`` reaches the scene description of the
  next answer (the path camera frames take).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import numpy as np
import pytest

from tests.serve.helpers import TOKEN, run, serving, url
from tests.serve.pipeline_helpers import ALWAYS_SCENE, SENTENCES, recall, speech
from tristream.serve.client import RealtimeClient
from tristream.serve.server import RealtimeServer

pytestmark = pytest.mark.slow


def pipeline_server(models: Any) -> AbstractAsyncContextManager[RealtimeServer]:
    from tristream.serve.pipeline_backend import PipelineBackend

    return serving(lambda: PipelineBackend(models, session_config=ALWAYS_SCENE))


async def until(c: RealtimeClient, stop: Callable[[dict[str, Any]], bool], timeout: float = 60.0) -> list[dict]:
    """Server events up to and including the first that satisfies ``stop``; errors fail the test."""
    seen: list[dict[str, Any]] = []
    while True:
        ev = await c.recv(timeout)
        seen.append(ev)
        assert ev["type"] != "error", ev
        if stop(ev):
            return seen


def is_type(t: str) -> Callable[[dict[str, Any]], bool]:
    return lambda ev: ev["type"] == t


async def send_audio(c: RealtimeClient, pcm: np.ndarray) -> None:
    for k in range(0, pcm.size, 480):  # 20 ms at 24 kHz, as fast as the socket takes it
        await c.append_audio(pcm[k:k + 480])


def answer_of(events: list[dict[str, Any]]) -> str:
    return "".join(ev["delta"] for ev in events if ev["type"] == "response.audio_transcript.delta")


def backend_of(srv: RealtimeServer) -> Any:
    (conn,) = srv.conns.values()
    return conn.session.backend


def test_manual_commit_ends_turn_and_clear_drops_audio(pipeline_models: Any) -> None:
    first, second = speech(pipeline_models, SENTENCES[2]), speech(pipeline_models, SENTENCES[4])

    async def go() -> None:
        async with pipeline_server(pipeline_models) as srv:
            c = await RealtimeClient.connect(url(srv), TOKEN)
            await c.send({"type": "session.update", "session": {"turn_detection": None}})
            upd = await until(c, is_type("session.updated"))
            assert upd[-1]["session"]["turn_detection"] is None
            await send_audio(c, first)
            await c.send({"type": "input_audio_buffer.clear"})
            await until(c, is_type("input_audio_buffer.cleared"))
            await send_audio(c, second)
            await c.send({"type": "input_audio_buffer.commit"})
            evs = await until(c, is_type("conversation.item.input_audio_transcription.completed"))
            types = [e["type"] for e in evs]
            assert "input_audio_buffer.committed" in types
            assert not any(t.startswith("input_audio_buffer.speech_") for t in types)  # no server VAD
            transcript = evs[-1]["transcript"]
            assert recall(SENTENCES[4], transcript) >= 0.75, transcript
            assert recall(SENTENCES[2], transcript) < 0.5, transcript  # the cleared audio is gone
            # a round trip after the transcript: still no answer, the turn is held
            await c.send({"type": "session.update", "session": {}})
            evs = await until(c, is_type("session.updated"))
            assert not any(e["type"].startswith("response.") for e in evs)
            b = backend_of(srv)
            assert b._gate.held is not None and b.session.records == []
            assert b.counters()["manual_buffer_cleared"] == 1
            await c.send({"type": "response.create"})
            evs = await until(c, is_type("response.done"))
            assert evs[-1]["response"]["status"] == "completed"
            answer = answer_of(evs)
            assert answer.startswith("You said:") and recall(SENTENCES[4], answer) >= 0.75, answer
            assert any(e["type"] == "response.audio.delta" for e in evs)
            await c.close()
    run(go(), timeout=120)


def test_server_vad_create_response_false_waits_for_response_create(pipeline_models: Any) -> None:
    pcm = speech(pipeline_models, SENTENCES[3])

    async def go() -> None:
        async with pipeline_server(pipeline_models) as srv:
            c = await RealtimeClient.connect(url(srv), TOKEN)
            await c.send({"type": "session.update", "session": {
                "turn_detection": {"type": "server_vad", "create_response": False}}})
            await until(c, is_type("session.updated"))
            await send_audio(c, pcm)
            evs = await until(c, is_type("conversation.item.input_audio_transcription.completed"))
            types = [e["type"] for e in evs]
            assert "input_audio_buffer.speech_started" in types and "input_audio_buffer.speech_stopped" in types
            transcript = evs[-1]["transcript"]
            assert recall(SENTENCES[3], transcript) >= 0.75, transcript
            await c.send({"type": "session.update", "session": {}})
            evs = await until(c, is_type("session.updated"))
            assert not any(e["type"].startswith("response.") for e in evs)
            b = backend_of(srv)
            assert b._gate.held is not None and b.session.records == []
            await c.send({"type": "response.create"})
            evs = await until(c, is_type("response.done"))
            assert evs[-1]["response"]["status"] == "completed"
            assert answer_of(evs) == "You said: " + transcript.strip()
            lat = evs[-1]["x_tristream"]["latency_ms"]
            assert 0 <= lat["eos_to_first_text_ms"] < 10_000  # counted from response.create, not the speech
            await c.close()
    run(go(), timeout=120)


def test_turn_detection_updates_apply_to_the_running_session(pipeline_models: Any) -> None:
    """A client's ``silence_duration_ms`` and ``semantic_vad`` change the live session's turn
    taking (the session starts before the client's first update): a longer silence holds the
    answer back by the difference; ``semantic_vad`` is echoed with its eagerness."""
    import time

    from tristream.pipeline.turns import EAGERNESS_HOLD_MS, SemanticEndOfTurn

    pcm = speech(pipeline_models, SENTENCES[3])

    async def go() -> None:
        async with pipeline_server(pipeline_models) as srv:
            c = await RealtimeClient.connect(url(srv), TOKEN)
            await c.send({"type": "session.update", "session": {
                "turn_detection": {"type": "semantic_vad", "eagerness": "low"}}})
            evs = await until(c, is_type("session.updated"))
            assert evs[-1]["session"]["turn_detection"] == {"type": "semantic_vad", "eagerness": "low",
                                                            "create_response": True, "interrupt_response": True}
            det = backend_of(srv).session.turns.detector
            assert isinstance(det, SemanticEndOfTurn) and det.hold_ms == EAGERNESS_HOLD_MS["low"]
            await c.send({"type": "session.update", "session": {
                "turn_detection": {"type": "server_vad", "silence_duration_ms": 1300}}})
            await until(c, is_type("session.updated"))
            turns = backend_of(srv).session.turns
            assert turns.extra_silence_ms == 1300 - backend_of(srv).session.config.hangover_ms
            await send_audio(c, pcm)
            await send_audio(c, np.zeros(24_000, np.int16))
            stopped = created = None
            while created is None:
                ev = await c.recv(60)
                assert ev["type"] != "error", ev
                if ev["type"] == "input_audio_buffer.speech_stopped":
                    stopped = time.monotonic()
                elif ev["type"] == "response.created":
                    created = time.monotonic()
            assert stopped is not None and created - stopped >= 0.9 * turns.extra_silence_ms / 1000
            evs = await until(c, is_type("response.done"))
            assert evs[-1]["response"]["status"] == "completed"
            await c.close()
    run(go(), timeout=120)


def _jpeg_url() -> str:
    import cv2

    yy, xx = np.mgrid[0:96, 0:128]
    img = np.stack([xx % 256, yy % 256, np.full_like(xx, 200)], axis=-1).astype(np.uint8)
    return "data:image/jpeg;base64," + base64.b64encode(cv2.imencode(".jpg", img)[1].tobytes()).decode()


def test_input_image_reaches_the_next_answers_scene(pipeline_models: Any) -> None:
    async def ask(c: RealtimeClient, content: list[dict[str, Any]]) -> str:
        await c.send({"type": "conversation.item.create",
                      "item": {"type": "message", "role": "user", "content": content}})
        await until(c, is_type("conversation.item.created"))
        await c.send({"type": "response.create"})
        evs = await until(c, is_type("response.done"))
        assert evs[-1]["response"]["status"] == "completed"
        return answer_of(evs)

    async def go() -> None:
        async with pipeline_server(pipeline_models) as srv:
            c = await RealtimeClient.connect(url(srv), TOKEN)
            plain = await ask(c, [{"type": "input_text", "text": "What is this?"}])
            assert plain == "You said: What is this?"  # no frame yet: no scene
            seen = await ask(c, [{"type": "input_text", "text": "And now?"},
                                 {"type": "input_image", "image_url": _jpeg_url()}])
            assert seen == "You said: And now? (camera seen)"
            assert backend_of(srv).counters()["images_to_scene"] == 1
            # an undecodable image refuses the item with an error; the session goes on
            await c.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [
                    {"type": "input_image", "image_url": "data:image/png;base64," + base64.b64encode(
                        b"\x89PNG not really").decode()}]}})
            err = await c.recv(10)
            assert err["type"] == "error" and err["error"]["code"] == "invalid_value"
            assert err["error"]["param"] == "item.content"
            await c.close()
    run(go(), timeout=120)


def test_text_only_turns_do_no_tts(pipeline_models: Any) -> None:
    """``modalities: ["text"]`` (session) and a per-response ``["text"]``: text out, no synthesis at all."""

    async def ask(c: RealtimeClient, text: str, response: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        await c.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
        await c.send({"type": "response.create", **({"response": response} if response else {})})
        return await until(c, is_type("response.done"))

    async def go() -> None:
        async with pipeline_server(pipeline_models) as srv:
            c = await RealtimeClient.connect(url(srv), TOKEN)
            await c.send({"type": "session.update", "session": {"modalities": ["text"]}})
            await until(c, is_type("session.updated"))
            tts = backend_of(srv).session.tts_stage
            evs = await ask(c, "Hello there.")
            kinds = {ev["type"] for ev in evs}
            assert "response.text.done" in kinds and "response.audio.delta" not in kinds, kinds
            assert evs[-1]["response"]["status"] == "completed"
            assert tts.pieces == 0  # the TTS stage synthesised nothing
            await c.send({"type": "session.update", "session": {"modalities": ["text", "audio"]}})
            await until(c, is_type("session.updated"))
            evs = await ask(c, "And now?", {"modalities": ["text"]})  # this answer only: text
            assert "response.audio.delta" not in {ev["type"] for ev in evs}
            evs = await ask(c, "Speak now.")  # the session's modalities again: spoken
            assert any(ev["type"] == "response.audio.delta" for ev in evs)
            await c.close()

    run(go(), timeout=120)
