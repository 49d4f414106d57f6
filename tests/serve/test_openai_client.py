"""The official `openai` package's Realtime client (beta, realtime=v1) against our server on loopback."""

from __future__ import annotations

import base64

import pytest

from tests.serve.helpers import TOKEN, run, running_server, tone_turns

openai = pytest.importorskip("openai")


def test_openai_realtime_client_text_and_audio() -> None:
    async def go() -> None:
        async with running_server() as srv:
            client = openai.AsyncOpenAI(api_key=TOKEN, websocket_base_url=f"ws://127.0.0.1:{srv.port}/v1")
            async with client.beta.realtime.connect(model="tristream-embedded") as conn:
                first = await conn.recv()
                assert first.type == "session.created"
                await conn.session.update(session={"modalities": ["text"], "instructions": "be brief"})
                ev = await conn.recv()
                assert ev.type == "session.updated" and ev.session.modalities == ["text"]
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "hi from openai"}]})
                await conn.response.create()
                text, done = "", None
                async for ev in conn:
                    if ev.type == "response.text.delta":
                        text += ev.delta
                    elif ev.type == "response.done":
                        done = ev
                        break
                    assert ev.type != "error", ev
                assert text == "echo: hi from openai"
                assert done is not None and done.response.status == "completed"
                assert done.response.output[0].content[0].text == text

                # Audio through the official client: server VAD, transcription, audio answer.
                await conn.session.update(session={"modalities": ["text", "audio"]})
                pcm = tone_turns([500])
                for k in range(0, pcm.size, 4800):
                    await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[k:k + 4800].tobytes()).decode())
                types, transcript, audio_bytes = [], "", 0
                async for ev in conn:
                    types.append(ev.type)
                    if ev.type == "conversation.item.input_audio_transcription.completed":
                        transcript = ev.transcript
                    elif ev.type == "response.audio.delta":
                        audio_bytes += len(base64.b64decode(ev.delta))
                    elif ev.type == "response.done":
                        break
                assert "input_audio_buffer.speech_started" in types and "input_audio_buffer.speech_stopped" in types
                assert transcript == "speech 500 ms"
                assert audio_bytes > 0
    run(go())
