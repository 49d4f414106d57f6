"""`conversation.item.truncate`, `response.metadata` and the reason of a cancelled answer.

The protocol side runs on `EchoBackend` (no models: what is checked is the session's events);
the history cut runs on the real pipeline behind `ToolPipelineBackend` and `PipelineBackend` (the `tristream serve`
backend: real VAD, Whisper, piper and the real-time playout; the scripted `RepeatChat` LLM, since
what matters is which words of the played answer the history keeps, not what the model says).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import numpy as np
import pytest

from tests.serve.helpers import tone_turns
from tristream.serve.echo import EchoBackend
from tristream.serve.session import RealtimeSession


def _text_item(text: str) -> str:
    return json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})


async def _until(out: list[dict[str, Any]], etype: str, start: int = 0, timeout: float = 60.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for ev in out[start:]:
            if ev["type"] == etype:
                return ev
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {etype} in {[e['type'] for e in out[start:]]}")


def _echo(pace: float = 0.0) -> tuple[RealtimeSession, list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    s = RealtimeSession("s", EchoBackend(pace=pace), out.append, time.monotonic_ns)
    return s, out


def test_unknown_item_id_is_an_error_and_the_session_goes_on() -> None:
    async def go() -> None:
        s, out = _echo()
        await s.open()
        s.handle_message(json.dumps({"type": "conversation.item.truncate", "item_id": "item_nope",
                                     "content_index": 0, "audio_end_ms": 100, "event_id": "ev1"}))
        err = out[-1]
        assert err["type"] == "error" and err["error"]["code"] == "invalid_value"
        assert err["error"]["param"] == "item_id" and err["error"]["event_id"] == "ev1"
        assert "item_nope" in err["error"]["message"]
        s.handle_message(_text_item("hello"))  # a known item (a user message): truncated, nothing changes
        item_id = out[-1]["item"]["id"]
        s.handle_message(json.dumps({"type": "conversation.item.truncate", "item_id": item_id,
                                     "content_index": 0, "audio_end_ms": 0}))
        assert out[-1] == {**out[-1], "type": "conversation.item.truncated", "item_id": item_id, "audio_end_ms": 0}
        s.handle_message(json.dumps({"type": "conversation.item.truncate", "item_id": item_id,
                                     "content_index": 0, "audio_end_ms": -5}))
        assert out[-1]["type"] == "error" and out[-1]["error"]["param"] == "audio_end_ms"
        await s.close()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_response_metadata_is_echoed_in_created_and_done() -> None:
    async def go() -> None:
        s, out = _echo()
        await s.open()
        meta = {"client_event_id": "response_create_abc", "topic": "weather"}
        s.handle_message(_text_item("hi"))
        n = len(out)
        s.handle_message(json.dumps({"type": "response.create", "response": {"metadata": meta}}))
        created = await _until(out, "response.created", n)
        done = await _until(out, "response.done", n)
        assert created["response"]["metadata"] == meta and done["response"]["metadata"] == meta
        n = len(out)  # the next answer, asked without metadata, has none
        s.handle_message(json.dumps({"type": "response.create"}))
        assert (await _until(out, "response.done", n))["response"]["metadata"] is None
        s.handle_message(json.dumps({"type": "response.create", "response": {"metadata": {"k": 3}}}))
        assert out[-1]["type"] == "error" and out[-1]["error"]["param"] == "response.metadata"
        await s.close()

    asyncio.run(asyncio.wait_for(go(), 30))


def _append(pcm: np.ndarray) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm.tobytes()).decode()})


def test_cancel_reason_turn_detected_on_barge_in_client_cancelled_on_response_cancel() -> None:
    async def go() -> None:
        s, out = _echo(pace=1.0)  # the echo answer plays in real time: there is time to speak over it
        await s.open()
        first = tone_turns([1500], gap_ms=1000)
        s.handle_message(_append(first))
        await _until(out, "response.audio.delta")  # the answer is playing
        n = len(out)
        s.handle_message(_append(tone_turns([600], gap_ms=800)))  # the user speaks over it
        done = await _until(out, "response.done", n)
        assert done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
        n = len(out)
        await _until(out, "response.audio.delta", n)  # the answer to the second turn
        s.handle_message(json.dumps({"type": "response.cancel"}))
        done = await _until(out, "response.done", n)
        assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
        await s.close()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_echo_answer_truncated_after_it_is_done() -> None:
    """A finished answer's item stays known: truncate answers truncated (echo keeps no history)."""
    async def go() -> None:
        s, out = _echo()
        await s.open()
        s.handle_message(_text_item("hi"))
        s.handle_message(json.dumps({"type": "response.create"}))
        done = await _until(out, "response.done")
        item = next(o for o in done["response"]["output"] if o["type"] == "message")
        s.handle_message(json.dumps({"type": "conversation.item.truncate", "item_id": item["id"],
                                     "content_index": 0, "audio_end_ms": 10}))
        assert out[-1]["type"] == "conversation.item.truncated" and out[-1]["item_id"] == item["id"]
        await s.close()

    asyncio.run(asyncio.wait_for(go(), 30))


LONG = ("Please turn on the kitchen lights, then tell me what the weather will be like tomorrow "
        "in Paris, and remind me to call my sister before dinner tonight.")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tools", "plain"])
def test_truncate_of_a_played_answer_cuts_the_history_to_the_words_played(pipeline_models: Any, kind: str) -> None:
    """On the default backend (with tools) and on the plain pipeline backend (the GPU server's)."""
    from tristream.pipeline.session import SessionConfig
    from tristream.serve.pipeline_backend import PipelineBackend
    from tristream.serve.tool_session import ToolPipelineBackend

    cls = ToolPipelineBackend if kind == "tools" else PipelineBackend

    async def go() -> None:
        backend = cls(pipeline_models, session_config=SessionConfig(max_sentences=0))
        out: list[dict[str, Any]] = []
        s = RealtimeSession("s", backend, out.append, time.monotonic_ns)
        await s.open()
        conv = backend.session.conversation

        async def answer(text: str) -> tuple[str, float, str]:
            n = len(out)
            s.handle_message(_text_item(text))
            s.handle_message(json.dumps({"type": "response.create"}))
            done = await _until(out, "response.done", n, timeout=120)
            assert done["response"]["status"] == "completed", done
            item = next(o for o in done["response"]["output"] if o["type"] == "message")
            audio_ms = done["x_tristream"]["audio_samples"] * 1000 / s.settings.output_audio_sample_rate
            return item["id"], audio_ms, item["content"][0]["transcript"]

        item_id, audio_ms, said = await answer(LONG)
        full = conv.messages[-1]
        assert full["role"] == "assistant" and len(full["content"].split()) >= 10, conv.messages
        assert audio_ms > 2000
        s.handle_message(json.dumps({"type": "conversation.item.truncate", "item_id": item_id,
                                     "content_index": 0, "audio_end_ms": int(audio_ms * 0.4)}))
        assert out[-1]["type"] == "conversation.item.truncated", out[-1]
        kept = conv.messages[-1]["content"].split()
        words = said.split()
        assert conv.messages[-1]["role"] == "assistant"
        assert 0 < len(kept) < len(words) and kept == words[:len(kept)], (kept, words)
        # the next prompt carries only the words played
        prompt = conv.prompt("next")
        assert " ".join(kept) in prompt[-2]["content"] and words[-1] not in prompt[-2]["content"].split()

        # nothing played: the answer leaves the history; a truncation at the full length changes nothing
        item2, audio2, _ = await answer("What is the weather like tomorrow?")
        last = conv.messages[-1]
        s.handle_message(json.dumps({"type": "conversation.item.truncate", "item_id": item2,
                                     "content_index": 0, "audio_end_ms": int(audio2) + 50}))
        assert conv.messages[-1] is last and out[-1]["type"] == "conversation.item.truncated"
        s.handle_message(json.dumps({"type": "conversation.item.truncate", "item_id": item2,
                                     "content_index": 0, "audio_end_ms": 0}))
        assert all(m is not last for m in conv.messages) and conv.messages[-1]["role"] == "user"
        await s.close()

    asyncio.run(asyncio.wait_for(go(), 240))

