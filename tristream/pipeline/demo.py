"""`tristream demo`: a short spoken conversation with a camera, through the real pipeline.

With no arguments the user's side is synthesised at start with the TTS stage (three
questions) and the camera is scikit-image's astronaut photo (shipped as
`tristream/data/demo_astronaut.jpg`) panned across the frame: a face that moves.
`wav`/`video` take the user's own recordings; `mic`/`camera` run live where the devices exist. Prints the transcript, the answers and a
per-turn latency table (end of speech → ASR final → first token → first audio) and writes
the answer audio to `out_wav`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tristream.pipeline.models import SharedModels, load_models
from tristream.pipeline.session import AudioCollector, Session, SessionConfig, TurnRecord
from tristream.sched.clock import MonotonicClock

SAMPLE_RATE = 16_000
CHUNK = 320  # 20 ms
DEMO_QUESTIONS = (
    "Hello, can you see me?",
    "What is the capital of France?",
    "Thank you, goodbye.",
)


class DemoInputError(RuntimeError):
    """A demo input (file or device) cannot be used; the message says why and what to do."""


@dataclass(slots=True)
class DemoResult:
    """Turn records, stats and where the answer audio went."""

    records: list[TurnRecord]
    stats: dict[str, Any]
    out_wav: Path | None
    answer_seconds: float
    barge_ins: list[dict[str, Any]] = field(default_factory=list)
    clip_end_ns: list[int] = field(default_factory=list)
    """Real-time runs of the bundled clips: the true end of each question (its last sample)."""


class FastClock(MonotonicClock):
    """Monotonic time without playout pacing (non-real-time runs: tests, batch files)."""

    async def sleep_until(self, t_ns: int) -> None:
        """Return at once (yielding to the loop)."""
        await asyncio.sleep(0)


def demo_conversation(tts: Any) -> list[np.ndarray]:
    """The user's side of the bundled conversation: one 16 kHz clip per question, the same samples
    on every run (a piper voice's random variation is off here: with it, Whisper base heard a few
    percent of the renditions of "the capital of France" as "the capital of friends")."""
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges

    synth = getattr(tts, "synthesize_exact", tts.synthesize)  # espeak is deterministic already
    clips = []
    for q in DEMO_QUESTIONS:
        pcm = resample(np.asarray(synth(q), dtype=np.float32), tts.sample_rate, SAMPLE_RATE)
        a, b = energy_edges(pcm, SAMPLE_RATE)
        clips.append(pcm[a:b])
    return clips


def _demo_image() -> np.ndarray:
    """420x420 RGB: the astronaut photo (NASA, public domain) shipped in tristream/data."""
    import cv2

    path = Path(__file__).resolve().parent.parent / "data" / "demo_astronaut.jpg"
    bgr = cv2.imread(str(path)) if path.is_file() else None
    if bgr is not None:
        return np.ascontiguousarray(bgr[:, :, ::-1])
    try:
        from skimage import data as skdata

        return cv2.resize(np.asarray(skdata.astronaut(), dtype=np.uint8), (420, 420), interpolation=cv2.INTER_AREA)
    except ImportError:  # a plain gradient still gives brightness and motion
        yy, xx = np.mgrid[0:420, 0:420]
        return np.stack([(xx // 2) % 256, (yy // 2) % 256, ((xx + yy) // 4) % 256], axis=-1).astype(np.uint8)


def demo_frames(fps: float = 5.0, seconds: float = 60.0) -> Iterator[tuple[float, np.ndarray]]:
    """(time s, frame) of the astronaut photo panning slowly left and right (320x240 RGB)."""
    small = _demo_image()
    for i in range(int(fps * seconds)):
        x = int(50 + 50 * np.sin(0.5 * i / fps))  # the face stays in view while the camera pans
        yield i / fps, np.ascontiguousarray(small[10:250, x:x + 320])


def _load_wav(path: str) -> np.ndarray:
    from tristream.stages.audio_io import load_wav_16k

    p = Path(path)
    if not p.is_file():
        raise DemoInputError(f"--wav {path}: no such file")
    try:
        pcm, _ = load_wav_16k(p)
    except Exception as e:
        raise DemoInputError(f"--wav {path}: cannot read it as a WAV file ({e}); give a PCM .wav") from e
    if pcm.size < SAMPLE_RATE // 4:
        raise DemoInputError(f"--wav {path}: only {pcm.size} samples; need at least 0.25 s of audio")
    return pcm


def _video_frames(path: str, max_frames: int = 1500) -> list[tuple[float, np.ndarray]]:
    """5 frames/s of the file, at most `max_frames` (5 min), at most 640 px wide (then looped)."""
    import cv2

    if not Path(path).is_file():
        raise DemoInputError(f"--video {path}: no such file")
    cap = cv2.VideoCapture(path)
    if not cap.isOpened():
        raise DemoInputError(f"--video {path}: OpenCV cannot open it; give an mp4/avi/mkv file")
    frames: list[tuple[float, np.ndarray]] = []
    fps = cap.get(cv2.CAP_PROP_FPS) or 25.0
    step = max(1, round(fps / 5))  # 5 frames/s are plenty for a scene description
    i = 0
    while True:
        ok, bgr = cap.read()
        if not ok:
            break
        if i % step == 0:
            h, w = bgr.shape[:2]
            if w > 640:  # bounded memory: 640 px wide is plenty for the scene description
                bgr = cv2.resize(bgr, (640, max(1, h * 640 // w)), interpolation=cv2.INTER_AREA)
            frames.append((i / fps, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)))
            if len(frames) >= max_frames:
                break
        i += 1
    cap.release()
    if not frames:
        raise DemoInputError(f"--video {path}: no frame could be decoded")
    return frames


def _frame_at(frames: list[tuple[float, np.ndarray]], k: int) -> tuple[float, np.ndarray]:
    """Frame `k` of the video played in a loop (so that long conversations keep a camera)."""
    n = len(frames)
    period = frames[-1][0] + (frames[1][0] - frames[0][0] if n > 1 else 0.2)
    ts, img = frames[k % n]
    return ts + (k // n) * period, img


async def _feed(session: Session, pcm: np.ndarray, t0_ns: int, offset: int, realtime: bool,
                frames: list[tuple[float, np.ndarray]], fi: list[int]) -> int:
    """Push `pcm` in 20 ms chunks starting at sample `offset`; frames whose time has come too."""
    clock = session.clock
    chunk_ns = CHUNK * 1_000_000_000 // SAMPLE_RATE
    for i in range(0, pcm.shape[0], CHUNK):
        idx = offset + i
        audio_t = idx * 1_000_000_000 // SAMPLE_RATE  # position in the recording
        if realtime:
            ref = t0_ns + audio_t
            await clock.sleep_until(ref + chunk_ns)
        else:
            ref = clock.now_ns() - chunk_ns  # compressed time: captured just now
        while frames:
            ts, img = _frame_at(frames, fi[0])
            if int(ts * 1e9) > audio_t + chunk_ns:
                break
            session.push_frame(img, ref + int(ts * 1e9) - audio_t if realtime else ref)
            fi[0] += 1
        session.push_audio(pcm[i:i + CHUNK], ref)
        if not realtime:
            await session.settle_input()
    return offset + pcm.shape[0]


async def run_session(models: SharedModels, clips: list[np.ndarray], frames: list[tuple[float, np.ndarray]],
                      realtime: bool = True, config: SessionConfig | None = None,
                      wait_each: bool = True, timeout_s: float = 60.0) -> tuple[Session, AudioCollector]:
    """Play `clips` (16 kHz) into a new session, waiting for each answer when `wait_each`."""
    sink = AudioCollector()
    clock = MonotonicClock() if realtime else FastClock()
    session = Session(models, sink=sink, clock=clock, config=config)
    session.start()
    t0 = clock.now_ns()
    offset, fi = 0, [0]
    lead = np.zeros(int(0.5 * SAMPLE_RATE), dtype=np.float32)
    offset = await _feed(session, lead, t0, offset, realtime, frames, fi)
    for k, clip in enumerate(clips):
        n_before = len(session.records)
        offset = await _feed(session, clip, t0, offset, realtime, frames, fi)
        if realtime:  # the clip's last sample on the reference clock: the true end of speech
            session.clip_end_ns.append(t0 + offset * 1_000_000_000 // SAMPLE_RATE)
        if wait_each or k == len(clips) - 1:
            offset = await _silence_until_done_after(session, n_before, t0, offset, realtime, frames, fi, timeout_s)
    await session.close()
    return session, sink


async def _silence_until_done_after(session: Session, n_before: int, t0: int, offset: int, realtime: bool,
                                    frames: list[tuple[float, np.ndarray]], fi: list[int], timeout_s: float) -> int:
    silence = np.zeros(CHUNK, dtype=np.float32)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(session.records) > n_before and session.current is None:
            break
        offset = await _feed(session, silence, t0, offset, realtime, frames, fi)
        if not realtime:
            await asyncio.sleep(0.002)
    else:
        session.drops.add("turn_timed_out")
    tail = np.zeros(int(0.4 * SAMPLE_RATE), dtype=np.float32)
    return await _feed(session, tail, t0, offset, realtime, frames, fi)


def check_devices(mic: bool, camera: bool) -> tuple[Any, Any]:
    """(sounddevice module, OpenCV capture) for a live run, or a `DemoInputError` saying what is missing."""
    if not mic:
        raise DemoInputError("--camera needs --mic too: turns are taken from speech")
    try:
        import sounddevice as sd
    except (ImportError, OSError) as e:
        raise DemoInputError(f"--mic needs the PortAudio library and `sounddevice` ({e}); "
                             "apt-get install libportaudio2 && pip install sounddevice") from e
    try:
        sd.query_devices(kind="input")
    except Exception as e:
        raise DemoInputError(f"--mic: no audio input device on this machine ({e})") from e
    cap = None
    if camera:
        import cv2

        cap = cv2.VideoCapture(0)
        if not cap.isOpened():
            raise DemoInputError("--camera: no camera could be opened (OpenCV device 0)")
    return sd, cap


async def _live(models: SharedModels, sd: Any, cap: Any, seconds: float,
                config: SessionConfig | None = None) -> Session:
    """Live microphone (sounddevice) and camera (OpenCV capture or None) for `seconds`."""

    class Speaker:
        def __init__(self) -> None:
            self.out: Any = None

        def write(self, pcm: np.ndarray, sample_rate: int) -> None:
            if self.out is None:
                self.out = sd.OutputStream(samplerate=sample_rate, channels=1, dtype="float32")
                self.out.start()
            self.out.write(pcm.reshape(-1, 1))

        def interrupt(self) -> None:
            if self.out is not None:
                self.out.abort()
                self.out.start()

    clock = MonotonicClock()
    session = Session(models, sink=Speaker(), clock=clock, config=config)
    session.start()
    loop = asyncio.get_running_loop()

    def on_audio(indata: np.ndarray, frames: int, t: Any, status: Any) -> None:
        now = clock.now_ns()
        pcm = indata[:, 0].copy()
        loop.call_soon_threadsafe(session.push_audio, pcm, now - frames * 1_000_000_000 // SAMPLE_RATE)

    with sd.InputStream(samplerate=SAMPLE_RATE, channels=1, dtype="float32", blocksize=CHUNK, callback=on_audio):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if cap is not None:
                ok, bgr = await loop.run_in_executor(None, cap.read)
                if ok:
                    session.push_frame(bgr[:, :, ::-1].copy(), clock.now_ns())
            await asyncio.sleep(0.2)
    if cap is not None:
        cap.release()
    await session.close()
    return session


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:7.0f}"


def print_report(records: list[TurnRecord], console: Any = None) -> None:
    """Transcript, answers and the per-turn latency table."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    for r in records:
        con.print(f"[bold cyan]user[/]: {r.user_text}")
        if r.scene:
            con.print(f"  [dim]{r.scene}[/]")
        said = r.heard if r.interrupted else r.answer
        con.print(f"[bold green]assistant[/]: {said.strip()}" + (" [red](interrupted)[/]" if r.interrupted else ""))
    t = Table(title="per-turn latency from end of speech (ms)")
    for col in ("turn", "ASR final", "first token", "first audio"):
        t.add_column(col, justify="right")
    for r in records:
        lat = r.latency_ms()
        t.add_row(str(r.turn_id), _ms(lat["asr_final"]), _ms(lat["first_token"]), _ms(lat["first_audio"]))
    con.print(t)


def run_demo(wav: str | None = None, video: str | None = None, mic: bool = False, camera: bool = False,
             realtime: bool = True, out_wav: str | None = "demo_answers.wav", llm_url: str | None = None,
             asr: str = "whisper", tts: str = "piper", seconds: float = 60.0, quiet: bool = False,
             config: SessionConfig | None = None) -> DemoResult:
    """Run the demo end to end (see module docstring); returns the turn records and stats."""
    clips = [_load_wav(wav)] if wav else None
    frames = _video_frames(video) if video else None
    devices = check_devices(mic, camera) if (mic or camera) else None
    models = load_models(asr=asr, tts=tts, vision=True, llm_url=llm_url)
    if devices is not None:
        session = asyncio.run(_live(models, devices[0], devices[1], seconds, config))
        sink = None
    else:
        if clips is None:
            clips = demo_conversation(models.tts)
        if frames is None:
            frames = list(demo_frames())
        session, sink = asyncio.run(run_session(models, clips, frames, realtime=realtime, config=config,
                                                wait_each=wav is None))
    out_path = None
    seconds_out = 0.0
    if sink is not None and sink.pieces and out_wav:
        from tristream.stages.audio_io import write_wav

        out_path = Path(out_wav)
        write_wav(out_path, sink.audio(), sink.sample_rate)
        seconds_out = sink.samples / sink.sample_rate
    if not quiet:
        print_report(session.records)
        if out_path is not None:
            print(f"answer audio: {out_path} ({seconds_out:.1f} s)")
    return DemoResult(session.records, session.stats(), out_path, seconds_out, session.barge_ins,
                      list(session.clip_end_ns))
