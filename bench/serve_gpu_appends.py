"""The GPU server's per-append work on its event loop, measured on CPU: N sessions' microphone
appends (and camera JPEGs) through the real server path, no GPU needed.

A `RealtimeServer` in this process serves N WebSocket sessions from a client process; each session
streams pcm16 at 24 kHz in 20 ms appends at real time with capture timestamps (low noise: the VAD
runs on every window, no speech starts a turn) and JPEG frames at ``--fps``. The backend is the GPU
server's (`PipelineBackend` with ``coalesce_audio`` and ``decode_frames_off_loop``, as
`VisionPipelineBackend`) over the real silero VAD and the CPU pipeline's streaming Whisper base
(its per-append ring; nothing is decoded without speech); the LLM and TTS never run. The GPU server
has more Python threads wanting the GIL (scheduler, ASR batcher, vision encoder): ``--gil-threads``
threads of pure Python work (1 ms steps) stand in for them, since a call that lets go of the GIL on
the loop thread then waits to take it back. Per N, over ``--seconds``: the main thread's CPU (% of
a core, µs per append), the event loop's lag (a 10 ms ticker's lateness, P50/P99/max), the main
thread's leaf frames (sampled at 200 Hz), and the VADs' windows precomputed off the loop vs run on it.
``--micro`` first: silero's cost per window in batches of 1, 8, 64 (ONNX Runtime's CPU provider,
one intra-op thread), and the cost per call on the calling thread of soxr's 20 ms chunk, the
polyphase one and a one-window VAD call, alone and with one GIL-holding thread beside it.
``--quality`` first: the bench's speech turns (`speech_turns.make_turns`: piper and espeak voices,
1-3 sentences) as the clients send them (24 kHz int16), brought to 16 kHz by soxr's `Resampler` and
by `PolyphaseResampler` in 20 ms chunks: the SNR of the polyphase output against soxr's, and the WER
of Whisper base (CPU, `WhisperASR.transcribe`) on each, and on the 16 kHz original.

    python3 bench/serve_gpu_appends.py --sessions 16 64 --label after
    PYTHONPATH=/tmp/old python3 bench/serve_gpu_appends.py --sessions 16 64 --label before --out serve_gpu_appends_before

(``/tmp/old``: ``git archive <commit> tristream | tar -x -C /tmp/old``, the code before.)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, machine_info  # noqa: E402

RATE = 24_000
STEP = RATE // 50
TOKEN = "bench-appends"


def _client(url: str, n: int, seconds: float, fps: float, jpegs: list[bytes], go: Any) -> None:
    from websockets.asyncio.client import connect

    async def one(k: int) -> None:
        rng = np.random.default_rng(k)
        pcm = (rng.standard_normal(int(RATE * (seconds + 2))) * 30).astype(np.int16)  # -60 dBFS noise
        async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, compression=None,
                           max_size=None) as ws:
            json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "session.update", "session": {"input_audio_sample_rate": RATE}}))

            async def drain() -> None:
                async for _ in ws:
                    pass
            dt = asyncio.get_running_loop().create_task(drain())
            await asyncio.sleep(0.5 + 0.5 * k / max(1, n))  # sessions' appends spread over the 20 ms
            t0 = time.perf_counter()
            next_frame = 0.0
            j = 0
            while True:
                ts = j * STEP / RATE
                if ts > seconds:
                    break
                delay = t0 + ts - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if fps and ts >= next_frame:
                    await ws.send(json.dumps({"type": "tristream.input_video_frame.append", "format": "jpeg",
                                              "stream_id": "camera", "capture_ts_us": int(ts * 1e6),
                                              "frame": base64.b64encode(jpegs[j % len(jpegs)]).decode()}))
                    next_frame += 1 / fps
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "capture_ts_us": int(ts * 1e6),
                                          "audio": base64.b64encode(pcm[j * STEP:(j + 1) * STEP].tobytes()).decode()}))
                j += 1
            dt.cancel()

    async def main() -> None:
        go.wait()
        await asyncio.gather(*(one(k) for k in range(n)))

    asyncio.run(main())


class Sampler:
    """The main thread's leaf frame, ``hz`` times a second, while on."""

    def __init__(self, hz: float = 200.0) -> None:
        self.hz, self.leaf, self.samples, self.on = hz, Counter[str](), 0, False
        self.main = threading.main_thread().ident
        threading.Thread(target=self._run, daemon=True, name="stack-sampler").start()

    def _run(self) -> None:
        while True:
            time.sleep(1 / self.hz)
            if not self.on:
                continue
            f = sys._current_frames().get(self.main)  # type: ignore[arg-type]
            if f is None:
                continue
            fn = f.f_code.co_filename
            i = fn.find("tristream/")
            self.leaf[f"{f.f_code.co_name} ({fn[i:] if i >= 0 else '/'.join(fn.split('/')[-2:])})"] += 1
            self.samples += 1

    def top(self, k: int = 12) -> list[tuple[str, float]]:
        return [(name, round(100 * v / max(1, self.samples), 1)) for name, v in self.leaf.most_common(k)]


def gil_load(stop: threading.Event) -> None:
    """Pure Python work in 1 ms steps (stands in for the GPU server's Python threads)."""
    while not stop.is_set():
        t = time.perf_counter() + 0.001
        while time.perf_counter() < t:
            pass
        time.sleep(0.001)


async def measure(n: int, args: argparse.Namespace, models: Any, jpegs: list[bytes], sampler: Sampler) -> dict[str, Any]:
    from tristream.serve.limits import ServerLimits
    from tristream.serve.pipeline_backend import PipelineBackend
    from tristream.serve.server import RealtimeServer

    class GpuServerAudio(PipelineBackend):  # the GPU server's per-append path (VisionPipelineBackend's flags)
        coalesce_audio = True
        decode_frames_off_loop = True

    backs: list[PipelineBackend] = []

    def factory() -> PipelineBackend:
        b = GpuServerAudio(models)
        backs.append(b)
        return b

    srv = RealtimeServer(factory, port=0, tokens=[TOKEN], limits=ServerLimits(max_sessions=n + 4))
    await srv.start()
    url = f"ws://127.0.0.1:{srv.port}/v1/realtime"
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    per = -(-n // args.clients)
    procs = [ctx.Process(target=_client, args=(url, min(per, n - i), args.seconds, args.fps, jpegs, go))
             for i in range(0, n, per)]
    for p in procs:
        p.start()
    await asyncio.sleep(1.0)
    go.set()
    while len(backs) < n or any(b.session is None for b in backs):
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.5)  # every session's appends under way
    lags: list[float] = []
    window = args.seconds - 2.5
    c0, w0 = time.thread_time(), time.perf_counter()
    s0 = sum(getattr(b.session.vad, "precomputed", 0) for b in backs)
    own0 = sum(b.session.vad.clock.total // 512 for b in backs)
    a0 = srv.metrics.render().count("")  # warm the renderer
    del a0
    sampler.leaf.clear()
    sampler.samples = 0
    sampler.on = True
    t_next = time.perf_counter() + 0.01
    while time.perf_counter() - w0 < window:
        await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
        lags.append((time.perf_counter() - t_next) * 1000)
        t_next += 0.01
    sampler.on = False
    cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
    windows = sum(b.session.vad.clock.total // 512 for b in backs) - own0
    pre = sum(getattr(b.session.vad, "precomputed", 0) for b in backs) - s0
    mism = sum(b.session.vad.counters.get("lookahead_mismatch", 0) for b in backs)
    appends = int(n * wall * 50)
    for p in procs:
        p.join(args.seconds + 30)
    await srv.stop(grace_s=0.0)
    lag = np.array(lags)
    return {"sessions": n, "wall_s": round(wall, 1), "main_thread_cpu_pct": round(100 * cpu / wall, 1),
            "main_thread_us_per_append": round(1e6 * cpu / max(1, appends), 1),
            "loop_lag_ms": {"p50": round(float(np.percentile(lag, 50)), 2), "p99": round(float(np.percentile(lag, 99)), 2),
                            "max": round(float(lag.max()), 2)},
            "vad_windows": windows, "vad_windows_precomputed": pre, "vad_lookahead_mismatches": mism,
            "main_leaf_pct": sampler.top()}


class _NoChat:
    """The LLM of these sessions: no turn starts (no speech), so it is never asked."""

    name = "none"

    async def stream(self, messages: list[dict[str, str]], max_tokens: int) -> Any:
        yield ""


def micro(vad: Any) -> dict[str, Any]:
    """Per-window VAD cost by batch size; per-call cost alone vs beside a GIL-holding thread."""
    from tristream.serve.audio import PolyphaseResampler
    from tristream.stages.base import Resampler

    def per_call(f: Any, n: int) -> float:
        for _ in range(10):
            f()
        t = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t) / n * 1e6

    out: dict[str, Any] = {"vad_us_per_window": {}}
    for b in (1, 8, 64):
        x, st = np.zeros((b, 576), np.float32), np.zeros((2, b, 128), np.float32)
        out["vad_us_per_window"][str(b)] = round(min(per_call(lambda x=x, st=st: vad.infer(x, st), 200 // b + 20)
                                                     for _ in range(3)) / b, 1)
    chunk = (np.random.default_rng(0).standard_normal(480) * 3000).astype(np.int16)
    sox, poly = Resampler(RATE, 16_000), PolyphaseResampler(RATE, 16_000)
    x1, s1 = np.zeros((1, 576), np.float32), np.zeros((2, 1, 128), np.float32)
    calls = {"soxr_chunk": lambda: sox.push(chunk), "polyphase_chunk": lambda: poly.push(chunk),
             "vad_one_window": lambda: vad.infer(x1, s1)}
    out["us_per_call_alone"] = {k: round(per_call(f, 500), 1) for k, f in calls.items()}
    stop = threading.Event()
    th = threading.Thread(target=gil_load_busy, args=(stop,), daemon=True)
    th.start()
    out["us_per_call_beside_a_gil_thread"] = {k: round(per_call(f, 200), 1) for k, f in calls.items()}
    stop.set()
    th.join()
    return out


def quality(turns_per_count: int = 2) -> dict[str, Any]:
    """SNR of the polyphase 24 → 16 kHz against soxr's on speech, and Whisper's WER on both."""
    from serve_gpu import _pcm24
    from speech_turns import make_turns, wer

    from tristream.serve.audio import PolyphaseResampler
    from tristream.stages.asr_whisper import WhisperASR
    from tristream.stages.base import Resampler

    def run(r: Any, x: np.ndarray) -> np.ndarray:
        return np.concatenate([r.push(x[i:i + STEP]) for i in range(0, x.size, STEP)] + [r.flush()])

    asr = WhisperASR(threads=2)
    turns = make_turns(sentence_counts=(1, 2, 3), per_count=turns_per_count)
    edits = {"original_16k": 0, "soxr": 0, "polyphase": 0}
    words = 0
    snrs = []
    per_turn = []
    for t in turns:
        pcm24 = _pcm24(t.pcm)
        sox = run(Resampler(RATE, 16_000), pcm24).astype(np.float32) / 32768
        poly = run(PolyphaseResampler(RATE, 16_000), pcm24).astype(np.float32) / 32768
        n = min(sox.size, poly.size)
        snr = 10 * np.log10(np.sum(sox[:n] ** 2) / max(1e-20, float(np.sum((sox[:n] - poly[:n]) ** 2))))
        snrs.append(float(snr))
        row: dict[str, Any] = {"voice": t.voice, "seconds": round(t.seconds, 2), "snr_db": round(float(snr), 1)}
        for name, x in (("original_16k", np.asarray(t.pcm, np.float32)), ("soxr", sox), ("polyphase", poly)):
            text = asr.transcribe(x)
            e, w = wer(t.text, text)
            edits[name] += e
            row[name] = text
        words += w
        per_turn.append(row)
    return {"turns": len(turns), "words": words, "snr_db_vs_soxr": {"min": round(min(snrs), 1),
            "median": round(float(np.median(snrs)), 1)},
            "wer": {k: round(v / max(1, words), 4) for k, v in edits.items()}, "per_turn": per_turn}


def gil_load_busy(stop: threading.Event) -> None:
    while not stop.is_set():
        s = 0
        for i in range(1000):
            s += i


def load_models() -> Any:
    from tristream.pipeline.models import SharedModels
    from tristream.stages.asr_stream import AgreementWhisper
    from tristream.stages.asr_whisper import WhisperASR
    from tristream.stages.tts import PiperTTS
    from tristream.stages.vad import SileroVAD

    return SharedModels(SileroVAD(threads=1), AgreementWhisper(WhisperASR(threads=1)), PiperTTS(deterministic=True),
                        None, _NoChat())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--fps", type=float, default=4.0)
    ap.add_argument("--gil-threads", type=int, default=1)
    ap.add_argument("--clients", type=int, default=32, help="sessions per client process")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="serve_gpu_appends")
    ap.add_argument("--micro", action="store_true", help="the per-call costs first (see above)")
    ap.add_argument("--micro-only", action="store_true", help="the per-call costs alone (no server, no models but the VAD)")
    ap.add_argument("--quality", action="store_true", help="the resamplers' SNR and WER on speech first (see above)")
    args = ap.parse_args()
    if args.micro_only:
        from tristream.stages.vad import SileroVAD

        m = micro(SileroVAD(threads=1))
        print(json.dumps(m), flush=True)
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / f"{args.out}.json").write_text(json.dumps({"meta": machine_info(("onnxruntime", "soxr")), "results": {
            "command": " ".join(["python3", "bench/serve_gpu_appends.py", *sys.argv[1:]]), "micro": m}}, indent=1) + "\n")
        return
    from serve_gpu import JPEGS, scene_frames

    JPEGS.extend(scene_frames())
    qual = quality() if args.quality else None
    if qual:
        print(json.dumps({k: v for k, v in qual.items() if k != "per_turn"}), flush=True)
    models = load_models()
    mic = micro(models.vad) if args.micro else None
    if mic:
        print(json.dumps(mic), flush=True)
    import tristream

    stop = threading.Event()
    for _ in range(args.gil_threads):
        threading.Thread(target=gil_load, args=(stop,), daemon=True, name="gil-load").start()
    sampler = Sampler()
    la0 = os.getloadavg()
    with open("/proc/stat") as fh:
        st0 = [int(x) for x in fh.readline().split()[1:]]
    runs = []
    for n in args.sessions:
        r = asyncio.run(measure(n, args, models, JPEGS, sampler))
        runs.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "main_leaf_pct"}), flush=True)
        for k, v in r["main_leaf_pct"][:8]:
            print(f"   leaf {v:5.1f}%  {k}", flush=True)
    stop.set()
    with open("/proc/stat") as fh:
        st1 = [int(x) for x in fh.readline().split()[1:]]
    d = [b - a for a, b in zip(st0, st1, strict=False)]
    out = {"command": " ".join(["python3", "bench/serve_gpu_appends.py", *sys.argv[1:]]), "label": args.label,
           "tristream_from": str(Path(tristream.__file__).resolve().parent), "seconds": args.seconds, "fps": args.fps,
           "gil_threads": args.gil_threads, "loadavg_before": la0, "loadavg_after": os.getloadavg(),
           "steal_pct": round(100 * d[7] / max(1, sum(d)), 2) if len(d) > 7 else None, "micro": mic, "quality": qual, "runs": runs}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{args.out}.json"
    path.write_text(json.dumps({"meta": machine_info(("onnxruntime", "soxr")), "results": out}, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
