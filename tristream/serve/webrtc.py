"""WebRTC transport (aiortc): OpenAI's SDP offer/answer flow, the ``oai-events`` data channel, Opus tracks.

A client POSTs an SDP offer (``Content-Type: application/sdp``, bearer token) to
``/v1/realtime/calls`` (or the beta path ``/v1/realtime``) on the server's side HTTP port and
gets the SDP answer (201). The call is one `RealtimeSession` over the server's backend
factory, like a WebSocket connection: client events arrive as text messages on the data
channel the client opens, named ``oai-events``; server events go back on it, except the answer
audio (``response.audio.delta``), which plays on the answer's Opus track instead. The user's
microphone arrives as an Opus track (aiortc's jitter buffer and decoder; 48 kHz frames) and
goes into the session's audio input (`RealtimeSession.push_audio`); the answer track plays
48 kHz mono from a buffer, silence when there is nothing to say, and drops what is buffered
when an answer is cancelled (barge-in).

Refused with HTTP 400 and a message: a body that is not an SDP offer, an offer without an
audio m-line. A call whose ``oai-events`` channel does not open within `DATA_CHANNEL_TIMEOUT_S`,
or whose connection fails, is closed and counted (``tristream_webrtc_calls_total{result}``).
Not done yet: the camera as a video track (RTP/RTCP capture times), loss statistics.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fractions
import json
import logging
import time
from typing import Any

import numpy as np

from tristream.serve import protocol as P
from tristream.serve.session import RealtimeSession

log = logging.getLogger("tristream.serve")
RATE = 48_000
FRAME = RATE // 50  # 20 ms
DATA_CHANNEL_TIMEOUT_S = 20.0
MAX_PENDING_EVENTS = 1024
_AUDIO_DELTAS = ("response.audio.delta", "response.output_audio.delta")


class SdpError(ValueError):
    """An offer this server cannot answer; the message says what to change."""


def answer_track() -> Any:
    """An `AnswerTrack` (aiortc imported on first use)."""
    from aiortc import MediaStreamTrack
    from aiortc.mediastreams import MediaStreamError
    from av import AudioFrame

    class AnswerTrack(MediaStreamTrack):  # type: ignore[misc]
        """The answer's audio: 20 ms frames at 48 kHz from a buffer, paced in real time."""

        kind = "audio"

        def __init__(self) -> None:
            super().__init__()
            self.buf = np.zeros(0, np.int16)
            self._start: float | None = None
            self._ts = 0
            self.played = 0  # answer samples sent (not silence)

        def add(self, pcm: np.ndarray) -> None:
            self.buf = np.concatenate([self.buf, pcm.astype(np.int16)])

        def clear(self) -> None:
            self.buf = np.zeros(0, np.int16)

        async def recv(self) -> Any:
            if self.readyState != "live":
                raise MediaStreamError
            if self._start is None:
                self._start = time.monotonic()
            else:
                self._ts += FRAME
                wait = self._start + self._ts / RATE - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            out = np.zeros(FRAME, np.int16)
            n = min(FRAME, self.buf.size)
            if n:
                out[:n] = self.buf[:n]
                self.buf = self.buf[n:]
                self.played += n
            frame = AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = RATE
            frame.pts = self._ts
            frame.time_base = fractions.Fraction(1, RATE)
            return frame

    return AnswerTrack()


def check_offer(sdp: str) -> None:
    """Refuse what is not an SDP offer with audio, before any peer connection is made."""
    if not sdp.lstrip().startswith("v=0"):
        raise SdpError("the body is not an SDP offer (it must start with 'v=0'; send the offer's sdp text "
                       "with Content-Type: application/sdp)")
    if "\nm=audio" not in "\n" + sdp.replace("\r\n", "\n"):
        raise SdpError("the offer has no audio m-line: add a microphone track (or an audio transceiver) "
                       "before creating the offer")


class WebRtcCall:
    """One call: a peer connection and its `RealtimeSession`."""

    def __init__(self, calls: WebRtcCalls, pc: Any) -> None:
        self.calls = calls
        self.pc = pc
        self.channel: Any = None
        self.pending: list[str] = []
        self.track = answer_track()
        self.opened = asyncio.Event()
        self.closed = False
        self.dropped = 0
        self.tasks: set[asyncio.Task[Any]] = set()
        srv = calls.server
        self.id = P.new_id("sess")
        self.session = RealtimeSession(self.id, srv.factory(), self.send, srv.clock_ns, srv.limits, srv.metrics,
                                       on_turn=lambda t: srv._on_turn(self.id, t))
        self.session.settings.output_audio_sample_rate = RATE

    def send(self, event: dict[str, Any]) -> None:
        """A server event: answer audio to the track, everything else to the data channel."""
        if event["type"] in _AUDIO_DELTAS:
            pcm = np.frombuffer(base64.b64decode(event["delta"]), np.int16)
            rate = self.session.settings.output_audio_sample_rate
            if rate != RATE:
                from tristream.stages.base import resample

                pcm = resample(pcm, rate, RATE)
            self.track.add(pcm)
            return
        if event["type"] == "response.done" and event["response"]["status"] == "cancelled":
            self.track.clear()
        msg = P.dumps(event)
        ch = self.channel
        if ch is not None and ch.readyState == "open":
            ch.send(msg)
        elif len(self.pending) < MAX_PENDING_EVENTS:
            self.pending.append(msg)
        else:
            self.dropped += 1
            self.calls.server.metrics.inc("tristream_events_dropped_total", reason="webrtc_channel_not_open")

    def on_channel(self, channel: Any) -> None:
        if channel.label != "oai-events":
            self.calls.server.metrics.inc("tristream_webrtc_channels_ignored_total")
            return
        self.channel = channel
        channel.on("message", self.on_message)

        def flush() -> None:
            for m in self.pending:
                channel.send(m)
            self.pending = []
            self.opened.set()

        if channel.readyState == "open":
            flush()
        else:
            channel.on("open", flush)

    def on_message(self, msg: Any) -> None:
        self.session.handle_message(msg if isinstance(msg, str) else bytes(msg))

    def on_track(self, track: Any) -> None:
        if track.kind == "audio":
            self._spawn(self.pump(track))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def pump(self, track: Any) -> None:
        """Microphone frames (decoded Opus, 48 kHz) into the session's audio input."""
        from aiortc.mediastreams import MediaStreamError

        while not self.closed:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            arr = frame.to_ndarray()
            ch = len(frame.layout.channels)
            pcm = arr.reshape(-1, ch)[:, 0] if arr.dtype == np.int16 else \
                np.clip(arr.reshape(-1, ch)[:, 0] * 32767, -32768, 32767).astype(np.int16)
            try:
                self.session.push_audio(np.ascontiguousarray(pcm), frame.sample_rate)
            except Exception:  # the backend refused one chunk: count it, the call goes on
                self.calls.server.metrics.inc("tristream_messages_dropped_total", reason="webrtc_audio_error")

    async def watch(self) -> None:
        """Close the call when its data channel never opens."""
        try:
            await asyncio.wait_for(self.opened.wait(), self.calls.data_channel_timeout_s)
        except TimeoutError:
            self.calls.count("no_data_channel")
            log.warning("webrtc call %s: no 'oai-events' data channel within %.0f s; closed", self.id,
                        self.calls.data_channel_timeout_s)
            await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.calls.calls.pop(self.id, None)
        for t in list(self.tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await self.session.close()
        with contextlib.suppress(Exception):
            await self.pc.close()


class WebRtcCalls:
    """The ``/v1/realtime/calls`` route of a `RealtimeServer` and its open calls."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.calls: dict[str, WebRtcCall] = {}
        self.data_channel_timeout_s = DATA_CHANNEL_TIMEOUT_S

    def count(self, result: str) -> None:
        self.server.metrics.inc("tristream_webrtc_calls_total", result=result)

    async def offer(self, sdp: str) -> tuple[int, str, bytes]:
        """Answer one offer: (HTTP status, content type, body)."""
        from aiortc import RTCPeerConnection, RTCSessionDescription

        try:
            check_offer(sdp)
        except SdpError as e:
            self.count("bad_offer")
            return 400, "application/json", _error(str(e), "sdp")
        if len(self.server.conns) + len(self.calls) >= self.server.limits.max_sessions:
            self.count("full")
            return 503, "application/json", _error(f"server full: {self.server.limits.max_sessions} sessions",
                                                   None, "server_error")
        pc = RTCPeerConnection()
        call = WebRtcCall(self, pc)
        pc.on("datachannel", call.on_channel)
        pc.on("track", call.on_track)

        @pc.on("connectionstatechange")  # type: ignore[misc]
        async def on_state() -> None:
            if pc.connectionState in ("failed", "closed"):
                self.count(f"connection_{pc.connectionState}")
                await call.close()

        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
            pc.addTrack(call.track)  # on the offer's audio transceiver
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as e:  # aiortc raises ValueError and others for an SDP it cannot use
            self.count("bad_offer")
            await pc.close()
            return 400, "application/json", _error(f"the SDP offer could not be answered: "
                                                   f"{type(e).__name__}: {e}", "sdp")
        self.calls[call.id] = call
        await call.session.open()
        call._spawn(call.watch())
        self.count("answered")
        return 201, "application/sdp", pc.localDescription.sdp.encode()

    async def close_all(self) -> None:
        for call in list(self.calls.values()):
            await call.close()


def _error(message: str, param: str | None, etype: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"type": etype, "code": "invalid_offer" if param == "sdp" else None,
                                 "message": message, "param": param}}).encode()
