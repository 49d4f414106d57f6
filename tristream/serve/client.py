"""Python client for the tristream Realtime server (raw ``websockets``, asyncio).

`RealtimeClient` is a thin connection (send events, iterate server events); `stream_media`
streams a WAV file (and optionally video frames) in real time like a microphone and camera
would, collects transcripts and answers, and measures on the client's clock:

- ``eos_to_first_audio_ms``: from sending the last voiced audio chunk of a turn (the user
  stopped talking) to the first ``response.audio.delta`` of the answer;
- ``eos_to_first_text_ms`` likewise for the first answer text.

Those include the server VAD's silence window, network and every stage: what a user feels.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import wave
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect

from tristream.serve import protocol as P
from tristream.stages.base import resample

CHUNK_MS = 20
# beta and GA names (the server mirrors the API shape the client's session.update used)
_TEXT_DELTAS = ("response.text.delta", "response.audio_transcript.delta", "response.output_text.delta",
                "response.output_audio_transcript.delta")
_AUDIO_DELTAS = ("response.audio.delta", "response.output_audio.delta")
VOICED_RMS = 0.02


class ClientError(Exception):
    """The server refused the connection or the media could not be read."""


@dataclass(slots=True)
class TurnResult:
    """What the client saw for one user turn."""

    transcript: str = ""
    answer: str = ""
    audio_samples: int = 0
    status: str = ""
    eos_to_first_text_ms: float | None = None
    eos_to_first_audio_ms: float | None = None
    server_latency_ms: dict[str, float] = field(default_factory=dict)


class RealtimeClient:
    """One WebSocket connection speaking the protocol of `tristream.serve.protocol`."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.session: dict[str, Any] = {}

    @classmethod
    async def connect(cls, url: str, token: str | None, open_timeout: float = 10.0) -> RealtimeClient:
        """Connect and wait for ``session.created``."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            ws = await connect(url, additional_headers=headers, max_size=16 << 20, open_timeout=open_timeout,
                               compression=None)
        except Exception as exc:
            raise ClientError(f"cannot open {url}: {exc}") from exc
        client = cls(ws)
        first = await client.recv()
        if first.get("type") != "session.created":
            raise ClientError(f"expected session.created, got {first.get('type')}: {first}")
        client.session = first["session"]
        return client

    async def send(self, event: dict[str, Any]) -> None:
        """Send one client event (a dict with ``type``)."""
        await self.ws.send(json.dumps(event, separators=(",", ":")))

    async def recv(self, timeout: float | None = None) -> dict[str, Any]:
        """Next server event."""
        raw = await asyncio.wait_for(self.ws.recv(), timeout)
        ev: dict[str, Any] = json.loads(raw)
        return ev

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Iterate server events until the connection closes."""
        async for raw in self.ws:
            yield json.loads(raw)

    async def append_audio(self, pcm: np.ndarray, capture_ts_us: int | None = None) -> None:
        """Send int16 samples at the session's input rate."""
        ev: dict[str, Any] = {"type": "input_audio_buffer.append",
                              "audio": base64.b64encode(np.asarray(pcm, "<i2").tobytes()).decode()}
        if capture_ts_us is not None:
            ev["capture_ts_us"] = capture_ts_us
        await self.send(ev)

    async def append_frame(self, jpeg: bytes, capture_ts_us: int, stream_id: str = "camera") -> None:
        """Send one JPEG camera frame with its capture time (the video extension)."""
        await self.send({"type": P.VIDEO_FRAME_EVENT, "format": "jpeg", "capture_ts_us": capture_ts_us,
                         "stream_id": stream_id, "frame": base64.b64encode(jpeg).decode()})

    async def close(self) -> None:
        """Close the connection."""
        await self.ws.close()


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """A 16-bit PCM WAV as mono int16 samples and its rate."""
    try:
        with wave.open(str(path), "rb") as w:
            if w.getsampwidth() != 2:
                raise ClientError(f"{path}: {8 * w.getsampwidth()}-bit WAV; convert to 16-bit PCM "
                                  "(e.g. `sox in.wav -b 16 out.wav`)")
            rate, ch = w.getframerate(), w.getnchannels()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    except (wave.Error, OSError) as exc:
        raise ClientError(f"{path}: not a readable WAV file: {exc}") from exc
    if ch > 1:
        pcm = pcm.reshape(-1, ch).mean(axis=1).astype(np.int16)
    return pcm, rate


def read_video_jpegs(path: Path, fps: float = 5.0, max_frames: int = 10_000) -> list[tuple[float, bytes]]:
    """(time s, JPEG bytes) frames from a folder of JPEGs (at ``fps``) or a video file (needs OpenCV)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
        return [(i / fps, f.read_bytes()) for i, f in enumerate(files[:max_frames])]
    try:
        import cv2
    except ImportError as exc:
        raise ClientError(f"{path}: reading a video file needs opencv-python-headless; or pass a folder of "
                          "JPEG frames") from exc
    cap = cv2.VideoCapture(str(path))
    if not cap.isOpened():
        raise ClientError(f"{path}: OpenCV cannot open this video")
    src_fps = cap.get(cv2.CAP_PROP_FPS) or 25.0
    step = max(1, round(src_fps / fps))
    out: list[tuple[float, bytes]] = []
    i = 0
    while len(out) < max_frames:
        ok, img = cap.read()
        if not ok:
            break
        if i % step == 0:
            ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 80])
            if ok:
                out.append((i / src_fps, buf.tobytes()))
        i += 1
    cap.release()
    return out


async def stream_media(
    url: str,
    token: str | None,
    pcm: np.ndarray,
    rate: int,
    frames: list[tuple[float, bytes]] | None = None,
    pace: float = 1.0,
    tail_silence_s: float = 1.5,
    answer_timeout_s: float = 30.0,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    expect_turns: int | None = None,
    session: dict[str, Any] | None = None,
) -> list[TurnResult]:
    """Stream audio (+frames) like a live mic, then wait for the last answer; one result per turn.

    ``pace`` 1.0 sends in real time, 0 as fast as possible (latencies then mean little).
    With ``expect_turns`` it waits for that many ``response.done`` instead of guessing from
    quiet time.
    """
    client = await RealtimeClient.connect(url, token)
    send_rate = rate if rate in P.SUPPORTED_SAMPLE_RATES else P.DEFAULT_SAMPLE_RATE
    if send_rate != rate:
        pcm = resample(np.asarray(pcm, np.int16), rate, send_rate)
    await client.send({"type": "session.update", "session": {"input_audio_sample_rate": send_rate, **(session or {})}})
    step = send_rate * CHUNK_MS // 1000
    pcm = np.concatenate([pcm, np.zeros(int(tail_silence_s * send_rate), dtype=np.int16)])
    results: list[TurnResult] = []
    transcripts: list[str] = []
    cur = TurnResult()
    # Without expect_turns the stream is over when the server has acknowledged a sync marker
    # sent after the last chunk (so every turn end was detected) and each detected turn has
    # been answered.
    state = {"last_voiced": 0.0, "eos": 0.0, "responses_open": 0, "stopped": 0, "updated": 0, "synced": False}

    def check_done() -> None:
        if expect_turns is not None:
            if len(results) >= expect_turns:
                done.set()
        elif state["synced"] and state["responses_open"] <= 0 and len(results) >= state["stopped"]:
            done.set()
    done = asyncio.Event()

    async def reader() -> None:
        nonlocal cur
        async for ev in client.events():
            if on_event is not None:
                on_event(ev)
            t, now = ev["type"], time.perf_counter()
            if t == "input_audio_buffer.speech_stopped":
                state["eos"] = state["last_voiced"]
                state["stopped"] += 1
            elif t == "session.updated":
                state["updated"] += 1
                if state["updated"] == 2:  # the sync marker's reply
                    state["synced"] = True
                    check_done()
            elif t == "conversation.item.input_audio_transcription.completed":
                transcripts.append(ev["transcript"])
            elif t == "response.created":
                state["responses_open"] += 1
            elif t in _TEXT_DELTAS:
                if cur.eos_to_first_text_ms is None and state["eos"]:
                    cur.eos_to_first_text_ms = (now - state["eos"]) * 1000
                cur.answer += ev["delta"]
            elif t in _AUDIO_DELTAS:
                if cur.eos_to_first_audio_ms is None and state["eos"]:
                    cur.eos_to_first_audio_ms = (now - state["eos"]) * 1000
                cur.audio_samples += len(base64.b64decode(ev["delta"])) // 2
            elif t == "response.done":
                state["responses_open"] -= 1
                cur.status = ev["response"]["status"]
                cur.server_latency_ms = ev.get("x_tristream", {}).get("latency_ms", {})
                cur.transcript = transcripts[len(results)] if len(results) < len(transcripts) else ""
                results.append(cur)
                cur = TurnResult()
                state["eos"] = 0.0
                check_done()
            elif t == "error" and ev["error"]["code"] != P.E_SHUTTING_DOWN:
                raise ClientError(f"server error {ev['error']['code']}: {ev['error']['message']}")

    rtask = asyncio.get_running_loop().create_task(reader())
    t0 = time.perf_counter()
    fi = 0
    frames = frames or []
    try:
        for i in range(0, pcm.size, step):
            chunk = pcm[i:i + step]
            t_chunk = i / send_rate
            while fi < len(frames) and frames[fi][0] <= t_chunk:
                await client.append_frame(frames[fi][1], int(frames[fi][0] * 1e6))
                fi += 1
            if pace > 0:
                delay = t0 + t_chunk * pace - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            await client.append_audio(chunk, capture_ts_us=int(t_chunk * 1e6))
            if np.sqrt(np.mean((chunk.astype(np.float32) / 32768.0) ** 2)) > VOICED_RMS:
                state["last_voiced"] = time.perf_counter()
            if rtask.done():
                break
        if not rtask.done():
            await client.send({"type": "session.update", "session": {}})  # sync marker
        waiter = asyncio.get_running_loop().create_task(done.wait())
        await asyncio.wait({waiter, rtask}, timeout=answer_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if rtask.done() and rtask.exception() is not None:
            raise rtask.exception()  # type: ignore[misc]
    finally:
        rtask.cancel()
        await client.close()
    return results
