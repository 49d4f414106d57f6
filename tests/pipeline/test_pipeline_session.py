"""The whole session with the real embedded models on synthesised speech.

Transcript words present, answer produced, audio written, scene described; barge-in stops
the answer within one chunk and the history keeps only what was heard; a flooded input is
bounded with its drops counted; bad input files give clear errors.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import numpy as np
import pytest

from tristream.pipeline.demo import DemoInputError, demo_frames, run_demo, run_session
from tristream.pipeline.session import AudioCollector, Session, SessionConfig
from tristream.sched.clock import VirtualClock

CHUNK = 320
CHUNK_NS = 20_000_000

pytestmark = pytest.mark.slow


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def test_conversation_end_to_end_with_real_models(models, say) -> None:
    clips = [say("What is the capital of France?"), say("Hello, can you see me?")]
    frames = list(demo_frames(seconds=10))
    session, sink = asyncio.run(run_session(models, clips, frames, realtime=False,
                                            config=SessionConfig(max_tokens=16), timeout_s=90))
    recs = session.records
    assert len(recs) == 2, session.stats()
    assert {"capital", "france"} <= _words(recs[0].user_text), recs[0].user_text  # pytest elides set reprs
    assert {"see", "me"} <= _words(recs[1].user_text), recs[1].user_text
    for r in recs:
        assert r.answer.strip(), r
        assert r.scene is not None and r.scene.startswith("camera:")
        lat = r.latency_ms()
        assert lat["asr_final"] is not None and lat["first_token"] is not None and lat["first_audio"] is not None
        assert lat["asr_final"] <= lat["first_token"] <= lat["first_audio"]
    assert "face" in (recs[0].scene or "")
    assert sink.samples > sink.sample_rate // 4  # answer audio was written
    assert float(np.abs(sink.audio()).max()) > 0.05
    # history: user, assistant, user, assistant with the answers as played
    roles = [m["role"] for m in session.conversation.messages]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert session.drops.snapshot().get("turn_timed_out", 0) == 0


class TurnSink(AudioCollector):
    """Remembers which turn each played chunk belonged to, and when interrupts came."""

    def __init__(self) -> None:
        super().__init__()
        self.session: Session | None = None
        self.log: list[tuple[int | None, int]] = []
        self.interrupt_at: list[int] = []
        self.times: list[int] = []

    def write(self, pcm: np.ndarray, sample_rate: int) -> None:
        super().write(pcm, sample_rate)
        cur = self.session.current if self.session is not None else None
        self.log.append((cur.turn_id if cur is not None else None, len(self.pieces)))
        self.times.append(self.session.clock.now_ns() if self.session is not None else 0)

    def interrupt(self) -> None:
        super().interrupt()
        self.interrupt_at.append(len(self.pieces))


def test_barge_in_stops_within_one_chunk_and_history_keeps_what_was_heard(models, say) -> None:
    async def main() -> tuple[Session, TurnSink, int]:
        clock = VirtualClock(start_ns=1_000_000_000)
        sink = TurnSink()
        session = Session(models, sink=sink, clock=clock, config=SessionConfig(max_tokens=24))
        sink.session = session
        session.start()

        async def feed(pcm: np.ndarray, real_pause: float = 0.0) -> None:
            for i in range(0, pcm.shape[0], CHUNK):
                session.push_audio(pcm[i:i + CHUNK], clock.now_ns())
                await session.settle_input()
                clock.advance(CHUNK_NS)  # one input chunk = one output chunk of playout
                await asyncio.sleep(real_pause)

        silence = np.zeros(CHUNK, dtype=np.float32)
        await feed(np.zeros(8000, dtype=np.float32))
        await feed(say("Tell me a long story about a dragon."))
        deadline = time.monotonic() + 90
        # wait until the answer has played for half a second (the echo gate knows this headset's
        # echo level by then: none)
        while sink.samples < 25 * CHUNK and time.monotonic() < deadline:
            await feed(silence, real_pause=0.01)
        assert sink.samples > 0, "no answer audio within 90 s"
        interrupted_turn = session.current.turn_id if session.current else -1
        await feed(say("Stop, please wait."))
        await feed(np.zeros(8000, dtype=np.float32))
        # shorter than `backchannel_max_ms`: its words decide, once its final is in
        deadline = time.monotonic() + 60
        while (not session.barge_ins or session.assistant_active) and time.monotonic() < deadline:
            await feed(silence, real_pause=0.01)  # and the answer to "Stop, please wait." ends
        await session.close()
        return session, sink, interrupted_turn

    session, sink, turn_id = asyncio.run(main())
    assert len(session.barge_ins) == 1, (session.barge_ins, session.overlaps, session.stats()["echo"], [(r.turn_id, r.status, r.user_text) for r in session.records])
    b = session.barge_ins[0]
    assert b["turn_id"] == turn_id
    # The answer's audio paused while handling the very chunk that holds the sample on which
    # the VAD decided the user speaks (the clock, at that chunk's start, had not moved on), and
    # the words that followed ("Stop, please wait": not an acknowledgement) interrupted it.
    paused = session.playout.paused_at_ns
    assert paused is not None and b["t_ns"] - CHUNK_NS <= paused < b["t_ns"] <= b["at_ns"]
    assert session.overlaps["interruptions"] == 1
    # No chunk of the interrupted answer was played after the pause.
    cut = sink.interrupt_at[0]
    assert all(n <= cut for t, n in sink.log if t == turn_id)
    assert not [w for (t, _), w in zip(sink.log, sink.times, strict=True) if t == turn_id and w > paused]
    rec = session.records[turn_id]
    assert rec.interrupted
    # History: the assistant message is exactly the heard part, a strict word prefix of the answer.
    heard = rec.heard.split()
    answer = rec.answer.split()
    assert heard == answer[: len(heard)] and len(heard) < len(answer)
    assistant_msgs = [m["content"] for m in session.conversation.messages if m["role"] == "assistant"]
    if heard:
        assert assistant_msgs[0] == rec.heard
    else:
        assert rec.answer not in assistant_msgs
    assert session.stats()["stages"][2]["interrupts"] == 1


def test_flooded_input_stays_bounded_and_counts_drops(models) -> None:
    async def main() -> tuple[int, dict[str, int], int]:
        session = Session(models, clock=VirtualClock())
        session.start()
        chunk = np.zeros(CHUNK, dtype=np.float32)
        for i in range(3000):  # 60 s of audio arriving while the loop is blocked
            session.push_audio(chunk, i * CHUNK_NS)
        high = session.input.inbox.high_water
        drops = session.input.inbox.drops.snapshot()
        await session.settle_input()
        await session.close()
        return high, drops, session.input.handled

    high, drops, handled = asyncio.run(main())
    assert high <= 256
    assert drops == {"inbox_full_drop_oldest": 3000 - 256}
    assert handled == 256


def test_bad_input_files_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DemoInputError, match="no such file"):
        run_demo(wav=str(tmp_path / "missing.wav"), quiet=True)
    bad = tmp_path / "noise.wav"
    bad.write_bytes(b"this is not a wav file at all" * 10)
    with pytest.raises(DemoInputError, match="cannot read it as a WAV"):
        run_demo(wav=str(bad), quiet=True)
    vid = tmp_path / "clip.mp4"
    vid.write_bytes(b"\x00" * 1000)
    with pytest.raises(DemoInputError, match="OpenCV cannot open it|no frame"):
        run_demo(video=str(vid), quiet=True)


def test_run_demo_with_wav_and_video_files_writes_answer_audio(models, say, tmp_path: Path) -> None:
    from tristream.stages.audio_io import read_wav, write_wav

    wav = tmp_path / "question.wav"
    pcm = np.concatenate([np.zeros(4000, np.float32), say("What colour is the sky?"), np.zeros(4000, np.float32)])
    write_wav(wav, pcm, 16_000)
    import cv2

    video = tmp_path / "camera.avi"  # a bright 1280x720 clip: downscaled, described as bright
    w = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 25, (1280, 720))
    for _ in range(25):
        w.write(np.full((720, 1280, 3), 235, np.uint8))
    w.release()
    out = tmp_path / "answers.wav"
    res = run_demo(wav=str(wav), video=str(video), realtime=False, out_wav=str(out), quiet=True,
                   config=SessionConfig(max_tokens=12))
    assert len(res.records) == 1 and "sky" in _words(res.records[0].user_text)
    assert res.records[0].scene is not None and "bright" in res.records[0].scene
    assert res.records[0].answer.strip()
    assert res.out_wav == out and out.is_file()
    audio, rate = read_wav(out)
    assert rate == 22050 and abs(audio.shape[0] - res.answer_seconds * rate) <= 1


def test_session_with_llm_url_pointing_at_our_engine_behind_an_openai_endpoint(models, say) -> None:
    """--llm-url path: the LLM stage streams over HTTP/SSE from our engine served on loopback."""
    import dataclasses

    from tests.pipeline.openai_server import OpenAICompatServer
    from tristream.pipeline.llm import OpenAIChatBackend

    async def main() -> tuple[Session, AudioCollector, int]:
        server = OpenAICompatServer(models.llm)
        await server.start()
        client = OpenAIChatBackend(server.url)
        remote = dataclasses.replace(models, llm=client)
        try:
            session, sink = await run_session(remote, [say("What is the capital of France?")],
                                              list(demo_frames(seconds=4)), realtime=False,
                                              config=SessionConfig(max_tokens=12), timeout_s=90)
        finally:
            await client.aclose()
            await server.close()
        return session, sink, server.requests

    session, sink, requests = asyncio.run(main())
    assert requests == 1
    assert len(session.records) == 1 and session.records[0].answer.strip()
    assert session.records[0].first_token_ns is not None
    assert sink.samples > 0


def test_models_are_loaded_once_per_process(models) -> None:
    from tristream.pipeline.models import load_models

    again = load_models(asr="whisper", tts="piper", vision=True)
    assert again is models
    a, b = Session(models, clock=VirtualClock()), Session(models, clock=VirtualClock())
    assert a.models.llm is b.models.llm and a.vad is not b.vad and a.tts is not b.tts


def test_live_mode_without_devices_says_what_is_missing() -> None:
    from tristream.pipeline.demo import check_devices

    with pytest.raises(DemoInputError, match="--camera needs --mic"):
        run_demo(camera=True, quiet=True)
    try:
        check_devices(mic=True, camera=True)
    except DemoInputError as e:
        assert re.search(r"--mic|--camera", str(e))
        with pytest.raises(DemoInputError, match=re.escape(str(e))):
            run_demo(mic=True, camera=True, quiet=True, seconds=0.1)
    else:
        pytest.skip("this machine has a microphone and a camera")


def test_half_duplex_ignores_the_microphone_while_answering(models) -> None:
    async def main() -> tuple[dict[str, int], int]:
        session = Session(models, clock=VirtualClock(), config=SessionConfig(barge_in=False))
        session.start()
        session.assistant_active = True  # an answer is playing
        for i in range(50):
            session.push_audio(np.full(CHUNK, 0.3, dtype=np.float32), i * CHUNK_NS)
        await session.settle_input()
        session.assistant_active = False
        await session.close()
        return session.drops.snapshot(), len(session.barge_ins)

    drops, barge_ins = asyncio.run(main())
    assert drops == {"half_duplex_muted": 50}
    assert barge_ins == 0


class _Scripted:
    """A chat backend of our own: the LLM stage of the session is anything that streams text."""

    name = "scripted"

    async def stream(self, messages: list[dict[str, str]], max_tokens: int):  # type: ignore[no-untyped-def]
        for w in ("Paris", " is", " the", " capital.", " Extra", " words."):
            yield w


def test_observers_see_the_conversation_in_order_and_a_custom_llm_stage(models, say) -> None:
    from tristream.observe.events import (
        AnswerText,
        ResponseDone,
        ResponseStarted,
        SpeechStarted,
        SpeechStopped,
        TranscriptDone,
    )

    async def go() -> tuple[list[object], list[object], Session]:
        clock = VirtualClock(start_ns=1_000_000_000)
        session = Session(models, clock=clock, llm=_Scripted(), config=SessionConfig(speak=False))
        seen: list[object] = []
        other: list[object] = []
        session.subscribe(seen.append)
        stop = session.subscribe(other.append)
        session.start()
        pcm = np.concatenate([np.zeros(8000, np.float32), say("What is the capital of France?"),
                              np.zeros(16000, np.float32)])
        for i in range(0, pcm.size, 320):  # 20 ms chunks on the virtual clock
            session.push_audio(pcm[i:i + 320], clock.now_ns())
            await session.settle_input()
            clock.advance(20_000_000)
            await asyncio.sleep(0)
        for _ in range(2000):
            if any(isinstance(e, ResponseDone) for e in seen):
                break
            clock.advance(20_000_000)
            await asyncio.sleep(0.005)
        stop()
        session.ask("And again?")  # a typed turn: only the first observer is still subscribed
        for _ in range(2000):
            if sum(isinstance(e, ResponseDone) for e in seen) == 2:
                break
            await asyncio.sleep(0.005)
        await session.close()
        return seen, other, session

    seen, other, session = asyncio.run(asyncio.wait_for(go(), 120))
    kinds = [type(e).__name__ for e in seen]
    order = [k for k in kinds if k in ("SpeechStarted", "SpeechStopped", "TranscriptDone", "ResponseStarted",
                                       "ResponseDone")]
    assert order == ["SpeechStarted", "SpeechStopped", "TranscriptDone", "ResponseStarted", "ResponseDone",
                     "ResponseStarted", "ResponseDone"], kinds
    done = [e for e in seen if isinstance(e, TranscriptDone)][0]
    assert {"capital", "france"} <= _words(done.text), done.text
    first = kinds.index("ResponseStarted")
    text = "".join(e.text for e in seen[first:kinds.index("ResponseDone")] if isinstance(e, AnswerText))
    assert text == "Paris is the capital."  # the custom stage's words, ended after the first sentence
    assert all(isinstance(e, ResponseDone) and e.status == "completed" for e in seen if isinstance(e, ResponseDone))
    assert not any(isinstance(e, ResponseStarted) for e in other[other.index(seen[kinds.index("ResponseDone")]) + 1:])
    assert isinstance(seen[0], SpeechStarted) and any(isinstance(e, SpeechStopped) for e in seen)
    assert session.records[-1].user_text == "And again?"
