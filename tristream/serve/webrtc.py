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
Losses: the audio jitter buffer (`gap_skipping_jitter_buffer`) reorders packets late by up to
80 ms and skips a hole after that (counted); packets that never arrive are counted
(``tristream_webrtc_rtp_packets_lost_total``, RFC 3550's expected - received, from the
receivers' stats once a second and at the end of each call). The camera arrives as a video
track whose frames are timed by RTP timestamps and RTCP sender reports (`SenderClock`).

As in OpenAI's WebRTC API, the data channel tells when the answer track carries an answer:
``output_audio_buffer.started`` (its first audio goes out), ``output_audio_buffer.stopped``
(the answer is done and its audio has all gone out) and ``output_audio_buffer.cleared`` (the
answer was cancelled and what was buffered is dropped), each with the ``response_id``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from typing import Any

import numpy as np

from tristream.serve import protocol as P
from tristream.serve.metrics import Family
from tristream.serve.session import RealtimeSession
from tristream.serve.webrtc_media import (
    JB_ATTR,
    RATE,
    VIDEO_CLOCK,
    SenderClock,
    answer_track,
    gap_skipping_jitter_buffer,
)

log = logging.getLogger("tristream.serve")
DATA_CHANNEL_TIMEOUT_S = 20.0
MAX_FPS = 5.0  # camera frames into the session per second (the aligner samples around speech anyway)
MAX_PENDING_EVENTS = 1024
_AUDIO_DELTAS = ("response.audio.delta", "response.output_audio.delta")


class SdpError(ValueError):
    """An offer this server cannot answer; the message says what to change."""


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
        self.rtp = {"received": 0, "lost": 0, "jitter": 0}
        self.response_id: str | None = None  # the answer whose audio the track carries
        self.response_done = False
        self.audio_open = False  # output_audio_buffer.started sent, stopped/cleared not yet
        self.track.on_start = self._audio_started
        self.track.on_drained = self._audio_drained

    def _audio_started(self) -> None:
        if not self.audio_open and self.response_id is not None:
            self.audio_open = True
            self._channel_send(P.server_event("output_audio_buffer.started", response_id=self.response_id))

    def _audio_drained(self) -> None:
        if self.audio_open and self.response_done:
            self.audio_open = False
            self._channel_send(P.server_event("output_audio_buffer.stopped", response_id=self.response_id))

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
        self._channel_send(event)
        etype = event["type"]
        if etype == "response.created":
            self.response_id, self.response_done = event["response"]["id"], False
        elif etype == "response.done":
            self.response_done = True
            if event["response"]["status"] == "cancelled":
                self.track.clear()
                if self.audio_open:
                    self.audio_open = False
                    self._channel_send(P.server_event("output_audio_buffer.cleared", response_id=self.response_id))
            elif not self.track.playing:
                self._audio_drained()

    def _channel_send(self, event: dict[str, Any]) -> None:
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
        elif track.kind == "video":
            recv = next((t.receiver for t in self.pc.getTransceivers() if t.receiver.track is track), None)
            if recv is not None:
                self._spawn(self.pump_video(track, SenderClock(recv, VIDEO_CLOCK)))

    async def pump_video(self, track: Any, clock: SenderClock) -> None:
        """Camera frames, timed by RTP/RTCP, into the session at up to `MAX_FPS`."""
        from aiortc.mediastreams import MediaStreamError

        last_us = -(1 << 62)
        m = self.calls.server.metrics
        while not self.closed:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            ts = clock.capture_us(int(frame.pts))
            if ts is None:
                m.inc("tristream_webrtc_video_frames_total", result="no_sender_report")
                continue
            if ts - last_us < 1e6 / MAX_FPS:
                m.inc("tristream_webrtc_video_frames_total", result="rate_limited")
                continue
            last_us = ts
            rgb = frame.to_ndarray(format="rgb24")
            try:
                self.session.push_video(rgb, ts)
                m.inc("tristream_webrtc_video_frames_total", result="taken")
            except Exception:  # a refused frame: counted, the call goes on
                m.inc("tristream_webrtc_video_frames_total", result="refused")

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def pump(self, track: Any) -> None:
        """Microphone frames (decoded Opus, 48 kHz) into the session's audio input."""
        from aiortc.mediastreams import MediaStreamError

        expect: int | None = None  # the pts the next frame should have (samples at the frame's rate)
        while not self.closed:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            arr = frame.to_ndarray()
            ch = len(frame.layout.channels)
            pcm = arr.reshape(-1, ch)[:, 0] if arr.dtype == np.int16 else \
                np.clip(arr.reshape(-1, ch)[:, 0] * 32767, -32768, 32767).astype(np.int16)
            pts, rate = frame.pts, frame.sample_rate
            if expect is not None and pts is not None and 0 < pts - expect <= rate:
                # lost packets: silence in their place keeps the audio's timeline (VAD timing, capture times)
                gap = pts - expect
                pcm = np.concatenate([np.zeros(gap, np.int16), pcm])
                self.calls.concealed_ms += gap * 1000 / rate
            if pts is not None:
                expect = pts + frame.samples
            try:
                self.session.push_audio(np.ascontiguousarray(pcm), rate)
            except Exception:  # the backend refused one chunk: count it, the call goes on
                self.calls.server.metrics.inc("tristream_messages_dropped_total", reason="webrtc_audio_error")

    async def rtp_stats(self) -> dict[str, int]:
        """RTP packets received and lost (RFC 3550: expected - received) and jitter (RTP units), summed over the
        call's receivers; aiortc's jitter buffer reorders late packets, lost ones leave gaps."""
        out = {"received": 0, "lost": 0, "jitter": 0}
        for r in self.pc.getReceivers():
            for st in (await r.getStats()).values():
                if getattr(st, "type", "") == "inbound-rtp":
                    out["received"] += int(st.packetsReceived)
                    out["lost"] += max(0, int(st.packetsLost))
                    out["jitter"] = max(out["jitter"], int(st.jitter))
        self.rtp = out
        return out

    async def watch(self) -> None:
        """Close the call when its data channel never opens."""
        try:
            await asyncio.wait_for(self.opened.wait(), self.calls.data_channel_timeout_s)
        except TimeoutError:
            self.calls.count("no_data_channel")
            log.warning("webrtc call %s: no 'oai-events' data channel within %.0f s; closed", self.id,
                        self.calls.data_channel_timeout_s)
            await self.close()

    async def poll_stats(self) -> None:
        """Refresh the RTP counters once a second (for /metrics)."""
        while not self.closed:
            await asyncio.sleep(1.0)
            with contextlib.suppress(Exception):
                await self.rtp_stats()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.calls.calls.pop(self.id, None)
        with contextlib.suppress(Exception):
            await self.rtp_stats()
        self.calls.closed_rtp["received"] += self.rtp["received"]
        self.calls.closed_rtp["lost"] += self.rtp["lost"]
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
        self.closed_rtp = {"received": 0, "lost": 0}
        self.jitter = {"skipped": 0, "late": 0}  # the audio jitter buffers' holes skipped, packets too late
        self.concealed_ms = 0.0  # microphone audio lost in transit, replaced by silence
        server.metrics.add_collector(self.families)

    async def refresh_stats(self) -> dict[str, int]:
        """RTP totals over open and closed calls (open calls' stats read now)."""
        out = dict(self.closed_rtp)
        for call in list(self.calls.values()):
            st = await call.rtp_stats()
            out["received"] += st["received"]
            out["lost"] += st["lost"]
        return out

    def families(self) -> list[Family]:
        """Prometheus families: RTP packets received and lost (open calls as of their last stats read)."""
        rx = self.closed_rtp["received"] + sum(c.rtp["received"] for c in self.calls.values())
        lost = self.closed_rtp["lost"] + sum(c.rtp["lost"] for c in self.calls.values())
        return [("tristream_webrtc_rtp_packets_received", "counter", "RTP packets received on WebRTC calls",
                 [("tristream_webrtc_rtp_packets_received_total", {}, float(rx))]),
                ("tristream_webrtc_rtp_packets_lost", "counter", "RTP packets lost on WebRTC calls (never arrived)",
                 [("tristream_webrtc_rtp_packets_lost_total", {}, float(lost))]),
                ("tristream_webrtc_jitter_skipped_packets", "counter",
                 "audio packets the jitter buffer gave up waiting for (lost or later than 80 ms)",
                 [("tristream_webrtc_jitter_skipped_packets_total", {}, float(self.jitter["skipped"]))]),
                ("tristream_webrtc_jitter_late_packets", "counter", "audio packets dropped: arrived after their slot",
                 [("tristream_webrtc_jitter_late_packets_total", {}, float(self.jitter["late"]))]),
                ("tristream_webrtc_audio_concealed_seconds", "counter",
                 "microphone audio lost in transit and replaced by silence (the timeline is kept)",
                 [("tristream_webrtc_audio_concealed_seconds_total", {}, self.concealed_ms / 1000)]),
                ("tristream_webrtc_calls_open", "gauge", "open WebRTC calls",
                 [("tristream_webrtc_calls_open", {}, float(len(self.calls)))])]

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
            for t in pc.getTransceivers():
                if t.kind == "audio" and hasattr(t.receiver, JB_ATTR):
                    setattr(t.receiver, JB_ATTR, gap_skipping_jitter_buffer(self.jitter))
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as e:  # aiortc raises ValueError and others for an SDP it cannot use
            self.count("bad_offer")
            await pc.close()
            return 400, "application/json", _error(f"the SDP offer could not be answered: "
                                                   f"{type(e).__name__}: {e}", "sdp")
        self.calls[call.id] = call
        await call.session.open()
        call._spawn(call.watch())
        call._spawn(call.poll_stats())
        self.count("answered")
        return 201, "application/sdp", pc.localDescription.sdp.encode()

    async def close_all(self) -> None:
        for call in list(self.calls.values()):
            await call.close()


def _error(message: str, param: str | None, etype: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"type": etype, "code": "invalid_offer" if param == "sdp" else None,
                                 "message": message, "param": param}}).encode()
