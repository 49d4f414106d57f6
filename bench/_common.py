"""Shared header for benchmark results: machine, versions and git commit.

Every benchmark writes `bench/results/<name>.json` as
`{"meta": machine_info(), "results": {...}}` via `write_results`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    """The commit the run is made from: ``TRISTREAM_GIT_COMMIT`` when set (the device copy of the
    tree carries a stale .git of its own), else the current commit (with `-dirty` when tracked
    files have uncommitted changes), or 'unknown'."""
    if os.environ.get("TRISTREAM_GIT_COMMIT"):
        return os.environ["TRISTREAM_GIT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("TRISTREAM_GIT_COMMIT", "unknown")


def _version(mod: str) -> str | None:
    try:
        m = importlib.import_module(mod)
    except Exception:
        return None
    return str(getattr(m, "__version__", "present"))


def machine_info(extra_modules: tuple[str, ...] = ()) -> dict[str, Any]:
    """Machine, interpreter, library versions and accelerator of this run."""
    info: dict[str, Any] = {
        "time_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    versions = {}
    for mod in ("numpy", "torch", "transformers", "triton", *extra_modules):
        v = _version(mod)
        if v is not None:
            versions[mod] = v
    info["versions"] = versions
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                           "count": torch.cuda.device_count(), "cuda": torch.version.cuda}
    except Exception:
        pass
    return info


def cpu_info() -> dict[str, Any]:
    """CPU model and the ISA flags that matter here, from lscpu."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    isa = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    return {"model_name": fields.get("Model name", "").strip(), "cpus": fields.get("CPU(s)", "").strip(),
            "isa_flags": isa, "flags": flags}


def write_results(name: str, results: dict[str, Any], extra_modules: tuple[str, ...] = ()) -> Path:
    """Write `bench/results/<name>.json` with the machine header; return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"meta": machine_info(extra_modules), "results": results}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def process_cpu_s(pid: int, children: bool = False) -> float:
    """User + system CPU seconds of process `pid` from /proc (with its reaped children's if asked)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    idx = (11, 12, 13, 14) if children else (11, 12)
    return sum(int(fields[i]) for i in idx) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nearest_rank_pct(xs: list[float], p: float) -> float:
    """The p-th percentile of xs by nearest rank (an observed value, no interpolation)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def host_speed(reps: int = 7) -> dict[str, float]:
    """This machine's speed at the host work of a streaming update, as two fixed workloads (median
    ms of `reps`): `python_ms`, 20,000 small dict/list/attribute operations; `numpy_ms`, 2,000
    numpy calls on 64-element arrays. Device machines differ call to call (the same host-only
    Whisper DTW timing ranged 0.39-0.48 ms on four H200 hosts): figures whose host share matters
    carry this beside them so runs on different machines can be compared."""
    import statistics

    import numpy as np

    def py() -> None:
        acc: list[dict[str, int]] = []
        for i in range(5000):
            d = {"a": i, "b": i + 1}
            acc.append(d)
            _ = d["a"] + len(acc)
        acc.clear()

    a = np.arange(64, dtype=np.float64)

    def nump() -> None:
        x = a
        for _ in range(1000):
            x = np.add(x, 1.0)
            _ = int(np.argmax(x))

    return {name: round(statistics.median(call_times(fn, reps)) * 1e3, 3)
            for name, fn in (("python_ms", py), ("numpy_ms", nump))}


def call_times(fn: Callable[[], object], reps: int, warm: int = 1,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """`fn` called `warm` times untimed, then `reps` times: the seconds of each of those by `clock`."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t = clock()
        fn()
        ts.append(clock() - t)
    return ts


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """`n` processes that only spin while the block runs (what another stage or program is to
    the code measured beside it); none for 0."""
    import multiprocessing as mp

    procs = [mp.get_context("spawn").Process(target=_spin, args=(3600.0,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    if procs:
        time.sleep(0.5)
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(5)


def capture_graph(fn: Callable[[], object], warm: int = 3, calls: int = 1) -> Any:
    """A `torch.cuda.CUDAGraph` of `calls` calls of `fn`, captured after `warm` calls on a side stream
    (Triton kernels compile and cuBLAS/cuFFT plans are made there, not inside the capture)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def cuda_graph_ms(graph: Any, warm: int = 5, reps: int = 50) -> float:
    """Milliseconds per replay of a captured `torch.cuda.CUDAGraph` (CUDA events, after `warm` replays)."""
    import torch

    for _ in range(warm):
        graph.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        graph.replay()
    e.record()
    e.synchronize()
    return float(s.elapsed_time(e)) / reps


def engine_graph_ms(eng: Any, batch: int, reps: int = 50) -> float | None:
    """ms per replay of the decode graph that runs `batch` rows in engine `eng`, alone (without the
    host side of a step), at the inputs of its last step; None without such a graph. Completes a
    step in flight first (its tokens are then dropped by the next replays) and holds the inputs
    (`DecodeGraphs.hold_inputs`: replays do not advance them); the engine's next step copies them
    again."""
    dec = eng.runner.decoder
    b = dec.bucket_for(batch) if dec is not None else None
    if b is None or b not in dec.graphs:
        return None
    hold_engine(eng)
    return cuda_graph_ms(dec.graphs[b], reps=reps)


def hold_engine(eng: Any) -> None:
    """Before replaying an engine's decode graphs by hand: complete a step in flight and make the
    replays keep the last step's inputs (`DecodeGraphs.hold_inputs`)."""
    while eng.overlap is not None and eng.overlap.in_flight:
        eng.step(allow=set())
    eng.runner.decoder.hold_inputs()


def kernel_profile(fn: Callable[[], object], top: int = 25) -> dict[str, Any]:
    """GPU kernels of one call of `fn` (graph replays included): count and time, largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    total_us, kernels = 0.0, 0
    for ev in prof.key_averages():
        dev_us = float(getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0) or 0.0)
        if getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type) and dev_us > 0:
            rows.append({"kernel": ev.key[:120], "count": int(ev.count), "us": round(dev_us, 1)})
            total_us += dev_us
            kernels += int(ev.count)
    rows.sort(key=lambda r: -r["us"])
    return {"kernels": kernels, "kernel_time_us": round(total_us, 1), "top": rows[:top]}


TEXT_DELTAS = ("response.text.delta", "response.output_text.delta", "response.audio_transcript.delta",
               "response.output_audio_transcript.delta")
AUDIO_DELTAS = ("response.audio.delta", "response.output_audio.delta")


def note_turn_event(cur: dict[str, Any], ev: dict[str, Any], now: float) -> bool:
    """Notes one Realtime server event on `cur`, the record of the turn a bench client is speaking.

    Always: the times (`now`, perf_counter s) of speech stopped, the transcript and the first answer
    text and audio; the transcripts, the responses, the last status, the server's latency and the
    errors. Where `cur` holds the key: the transcription ``deltas`` (and ``deltas_before_end``),
    the ``early_responses`` begun before the turn's audio was all sent, the ``answer`` text.
    Returns whether the answer is done: ``response.done`` once the audio is sent (``audio_sent``)."""
    t = ev["type"]
    if t == "input_audio_buffer.speech_stopped":
        cur["stopped"] = now
    elif t == "conversation.item.input_audio_transcription.delta" and "deltas" in cur:
        cur["deltas"] += 1
        if not cur.get("audio_sent"):
            cur["deltas_before_end"] += 1
    elif t == "conversation.item.input_audio_transcription.completed":
        cur["transcripts"].append(ev.get("transcript", ""))
        cur["completed"] = now
    elif t == "response.created":
        cur["responses"] += 1
        if "early_responses" in cur and not cur.get("audio_sent"):
            cur["early_responses"] += 1
        cur.pop("first_text", None)
        cur.pop("first_audio", None)
    elif t in TEXT_DELTAS:
        cur.setdefault("first_text", now)
        if "answer" in cur:
            cur["answer"] += ev.get("delta", "")
    elif t in AUDIO_DELTAS:
        cur.setdefault("first_audio", now)
    elif t == "response.done":
        cur["status"] = ev["response"].get("status")
        cur["server_latency_ms"] = ev.get("x_tristream", {}).get("latency_ms")
        return bool(cur.get("audio_sent"))
    elif t == "error":
        cur["errors"].append(ev.get("error", {}).get("message", "")[:120])
    return False


def turn_latencies_ms(cur: dict[str, Any]) -> dict[str, float | None]:
    """The client-side latencies (ms) of a turn `note_turn_event` noted on `cur` (with ``eos``, the
    end of its voiced audio): None where either end is missing."""
    def ms(a: str, b: str) -> float | None:
        return round((cur[b] - cur[a]) * 1000, 1) if a in cur and b in cur else None

    return {"stopped_to_transcript_ms": ms("stopped", "completed"),
            "stopped_to_first_text_ms": ms("stopped", "first_text"),
            "stopped_to_first_audio_ms": ms("stopped", "first_audio"),
            "eos_to_first_audio_ms": ms("eos", "first_audio")}


def last_voiced_chunk(pcm: Any, step: int, rms: float = 0.01) -> int:
    """The offset of the last `step`-sample chunk of int16 `pcm` above `rms` (full scale 1), else 0."""
    import numpy as np

    voiced = [i for i in range(0, pcm.size, step)
              if np.sqrt(np.mean((pcm[i:i + step].astype(np.float32) / 32768) ** 2)) > rms]
    return voiced[-1] if voiced else 0


class ServerDidNotStart(RuntimeError):
    """A starting ``tristream serve`` exited, or did not answer ``/healthz`` in time."""


def wait_healthy(proc: Any, port: int, timeout_s: float = 600.0, output: Callable[[], str] = lambda: "") -> None:
    """Polls ``GET /healthz`` of a starting server process on loopback `port` every 0.5 s until it answers.

    Raises `ServerDidNotStart` when `proc` exits first (the message ends with the last 2,000
    characters of `output()`, the server's log) or when `timeout_s` pass (then it kills `proc`)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerDidNotStart(f"tristream serve exited with {proc.returncode}: {output()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise ServerDidNotStart(f"tristream serve did not come up within {timeout_s:.0f} s") from None
            time.sleep(0.5)


def stop_process(proc: Any, timeout_s: float = 60.0) -> None:
    """SIGTERM a server subprocess (it drains), then SIGKILL it if it is still up after `timeout_s`."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
