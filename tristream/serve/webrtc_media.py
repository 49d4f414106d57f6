"""Media pieces of the WebRTC transport (aiortc): the answer's audio track, an audio jitter buffer
that skips holes, and capture times from RTP timestamps and RTCP sender reports.

Two of them reach into aiortc's receivers by their private names (the jitter buffer, the RTP
timestamp mapper, the RTCP handler), checked with `hasattr` where they are used; aiortc 1.16.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from typing import Any

import numpy as np

RATE = 48_000
FRAME = RATE // 50  # 20 ms


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
            self.playing = False  # the last frame carried answer audio
            self.on_start: Any = None  # called when answer audio starts going out after silence
            self.on_drained: Any = None  # called when the buffer runs dry after answer audio

        def add(self, pcm: np.ndarray) -> None:
            self.buf = np.concatenate([self.buf, pcm.astype(np.int16)])

        def clear(self) -> None:
            self.buf = np.zeros(0, np.int16)
            self.playing = False

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
            if bool(n) != self.playing:
                self.playing = bool(n)
                cb = self.on_start if n else self.on_drained
                if cb is not None:
                    cb()
            frame = AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = RATE
            frame.pts = self._ts
            frame.time_base = fractions.Fraction(1, RATE)
            return frame

    return AnswerTrack()


JB_ATTR = "_RTCRtpReceiver__jitter_buffer"
"""aiortc's private name of a receiver's jitter buffer (replaced per audio receiver, checked first)."""
_TS_ATTR = "_RTCRtpReceiver__timestamp_mapper"
VIDEO_CLOCK = 90_000


class SenderClock:
    """Capture times of a received stream from RTP timestamps and the sender's RTCP reports.

    An RTCP sender report pairs the sender's NTP wall clock with an RTP timestamp of the same
    stream; a frame's capture time is that NTP time plus its RTP distance from the report
    (32-bit wrap handled). aiortc's frames carry RTP timestamps rebased on the first packet
    (`TimestampMapper`), so its origin is added back. No report yet: no capture time."""

    def __init__(self, receiver: Any, rate: int) -> None:
        self.rate = rate
        self.mapper = getattr(receiver, _TS_ATTR, None)
        self.sr: tuple[float, int] | None = None  # (NTP seconds, RTP timestamp) of the latest report
        self.reports = 0
        handle = receiver._handle_rtcp_packet

        async def on_rtcp(packet: Any) -> None:
            info = getattr(packet, "sender_info", None)
            if info is not None:
                self.sr = (info.ntp_timestamp / (1 << 32) - 2_208_988_800, int(info.rtp_timestamp))
                self.reports += 1
            await handle(packet)

        receiver._handle_rtcp_packet = on_rtcp

    def capture_us(self, pts: int) -> int | None:
        """The sender's wall-clock capture time (µs since 1970) of a frame with this pts, or None."""
        if self.sr is None or self.mapper is None or self.mapper._origin is None:
            return None
        rtp = (pts + self.mapper._origin) & 0xFFFFFFFF
        d = (rtp - self.sr[1]) & 0xFFFFFFFF
        if d >= 1 << 31:
            d -= 1 << 32
        return int((self.sr[0] + d / self.rate) * 1e6)


def gap_skipping_jitter_buffer(counts: dict[str, int]) -> Any:
    """aiortc's audio jitter buffer, but a lost packet costs only its own 20 ms.

    aiortc's buffer waits at a hole until 16 packets (320 ms) are queued behind it and then
    discards frames: with 10% loss half the audio was gone. This one skips a hole as soon as
    `prefetch` (4 packets, 80 ms) have arrived after it, which also covers reordering by up to
    80 ms; skipped packets and packets that arrive after their hole was skipped are counted."""
    from aiortc.jitterbuffer import MAX_MISORDER, JitterBuffer, JitterFrame
    from aiortc.utils import uint16_add

    class GapSkippingJitterBuffer(JitterBuffer):  # type: ignore[misc]
        def add(self, packet: Any) -> Any:
            if self._origin is not None:
                delta = uint16_add(packet.sequence_number, -self._origin)
                misorder = uint16_add(self._origin, -packet.sequence_number)
                if misorder < delta and misorder < MAX_MISORDER:
                    counts["late"] += 1
            return super().add(packet)

        def _remove_frame(self, sequence_number: int) -> Any:
            """The oldest frame once `prefetch` packets are queued behind it; holes before it are skipped."""
            cap, origin = self._capacity, self._origin
            if origin is None:
                return None
            slots: list[Any] = self._packets
            present = [i for i in range(cap) if slots[(origin + i) % cap] is not None]
            if len(present) <= self._prefetch:
                return None
            if present[0]:
                counts["skipped"] += present[0]
                self.remove(present[0])
                origin = uint16_add(origin, present[0])
            first = slots[origin % cap]
            parts: list[Any] = []
            while len(parts) < cap:
                p = slots[(origin + len(parts)) % cap]
                if p is None or p.timestamp != first.timestamp:
                    break
                parts.append(p)
            self.remove(len(parts))
            return JitterFrame(data=b"".join(x._data for x in parts), timestamp=first.timestamp)

    return GapSkippingJitterBuffer(capacity=16, prefetch=4)
