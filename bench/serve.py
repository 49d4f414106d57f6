"""Serving benchmark: 1, 8 and 32 concurrent clients streaming audio in real time over loopback.

For each client count it starts the server in its own process (so its CPU time can be read
from /proc), connects N clients that stream the same speech-like WAV as live microphones
(20 ms chunks, real time), and measures:

- end of speech -> first answer audio, on the client's clock (from sending the last voiced
  chunk to receiving the first ``response.audio.delta``): P50 / P99. This includes the server
  VAD hangover (``silence_duration_ms``, 300 ms by default) — what a user waits;
- the same on the server's clock from its VAD decision (``x_tristream.latency_ms``): the
  processing part alone;
- server CPU per session: server process CPU seconds / (sessions x wall seconds), and per
  second of streamed audio (sessions x audio seconds), which late answers do not dilute.

The baseline in the same run is a *bare* WebSocket server (``--bare-server``): the same
energy VAD and echo answer with no validation, limits, metrics, recording or session state
machine — the floor of a Python WebSocket relay, so the table shows what our serving
layer costs on top. Backends: ``echo`` (no models; serving layer alone) or ``assistant``
(``pipeline`` is the same: the server's default, the embedded CPU assistant).

    .venv/bin/python bench/serve.py                 # echo backend, 1/8/32 clients
    .venv/bin/python bench/serve.py --backend assistant --clients 1 8

``--backend engine`` measures text turns on our engine through the scheduler instead
(``--device cuda|cpu --model NAME``): N clients (tiers gold/silver/bronze in turn) each send
``--turns`` questions with a random think time; per turn ``response.create`` -> first text delta
on the client's clock and the server's ``eos_to_first_text_ms``. Variants in the same run, one
server each: ``ours`` (our scheduler), ``fifo`` (the FIFO preset of the same scheduler) and
``none`` (the engine's own continuous batching, no scheduler: the peer); then a shed probe
(``ours`` with every silver/bronze end of turn timed out) gives ``response.create`` -> the
``scheduler_shed`` error on the client.

    .venv/bin/python bench/serve.py --backend engine --device cpu --model tiny-random --clients 1 8 32
    python3 bench/serve.py --backend engine --device cuda --model llama-3.2-1b --clients 1 8 32 64

``--backend speech`` measures spoken turns on the engine backend with the CPU speech stages
(``stages=embedded``: faster-whisper per utterance, the peer) and with ``stages=gpu`` (our batched
streaming Whisper on ``--device``) in the same run: end of speech -> ``.completed`` transcript and
-> first audio on the client, server CPU per session.

    .venv/bin/python bench/serve.py --backend speech --device cpu --clients 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import free_port, process_cpu_s, stop_process  # noqa: E402

TOKEN = "bench-token"


def speech_like(turns: int, rate: int = 24_000) -> np.ndarray:
    """Voiced bursts with a syllable-rate envelope (1.0-1.6 s) separated by 1.2 s of silence."""
    rng = np.random.default_rng(0)
    parts = [np.zeros(rate // 2, dtype=np.int16)]
    for i in range(turns):
        dur = 1.0 + 0.3 * (i % 3)
        t = np.arange(int(rate * dur)) / rate
        env = 0.55 + 0.45 * np.sin(2 * np.pi * 4.0 * t)
        sig = np.sin(2 * np.pi * (180 + 30 * i) * t) + 0.3 * rng.standard_normal(t.size)
        parts.append((sig * env * 4000).astype(np.int16))
        parts.append(np.zeros(int(rate * 1.2), dtype=np.int16))
    return np.concatenate(parts)


def real_speech(turns: int, gap_s: float, rate: int = 24_000) -> np.ndarray:
    """Piper-synthesised sentences (the pipeline needs words to transcribe) separated by silence."""
    from tristream.stages.base import resample
    from tristream.stages.synth import SENTENCES, energy_edges
    from tristream.stages.tts import PiperTTS

    tts = PiperTTS(deterministic=True)
    parts = [np.zeros(rate // 2, dtype=np.int16)]
    for i in range(turns):
        clip = resample(tts.synthesize(SENTENCES[i % len(SENTENCES)]), tts.sample_rate, rate)
        a, b = energy_edges(clip, rate)
        parts.append((clip[a:b] * 32767).astype(np.int16))
        parts.append(np.zeros(int(rate * gap_s), dtype=np.int16))
    return np.concatenate(parts)


# ------------------------------------------------------------------ bare baseline server


async def bare_server(port: int) -> None:
    """Same energy VAD + echo answer as EchoBackend, none of the serving layer."""
    from websockets.asyncio.server import serve

    async def handler(ws) -> None:  # type: ignore[no-untyped-def]
        await ws.send(json.dumps({"type": "session.created", "session": {}}))
        rate, flen = 24_000, 480
        pending = np.zeros(0, np.int16)
        in_speech, silence, turn = False, 0, []
        async for raw in ws:
            ev = json.loads(raw)
            if ev.get("type") != "input_audio_buffer.append":
                continue
            buf = np.concatenate([pending, np.frombuffer(base64.b64decode(ev["audio"]), "<i2")])
            n = buf.size // flen
            pending = buf[n * flen:]
            fr = buf[: n * flen].reshape(n, flen).astype(np.float32) / 32768
            voiced = np.sqrt((fr * fr).mean(axis=1)) > 0.02
            for i in range(n):
                if in_speech:
                    turn.append(buf[i * flen:(i + 1) * flen])
                    silence = 0 if voiced[i] else silence + 1
                    if silence >= 15:  # 300 ms, like EchoBackend with the default hangover
                        in_speech = False
                        await ws.send(json.dumps({"type": "input_audio_buffer.speech_stopped"}))
                        audio = np.concatenate(turn)
                        for k in range(0, audio.size, rate // 10):
                            await ws.send(json.dumps({"type": "response.audio.delta", "delta": base64.b64encode(
                                audio[k:k + rate // 10].tobytes()).decode()}))
                            await asyncio.sleep(0.1)
                        await ws.send(json.dumps({"type": "response.done", "response": {"status": "completed"}}))
                elif voiced[i]:
                    in_speech, silence, turn = True, 0, [buf[i * flen:(i + 1) * flen]]

    async with serve(handler, "127.0.0.1", port, compression=None, max_size=1 << 22):
        print(f"ready {port}", flush=True)
        await asyncio.Future()


# ------------------------------------------------------------------ clients


async def one_client(url: str, pcm: np.ndarray, turns: int, bare: bool, wait_s: float) -> dict[str, list[float]]:
    from websockets.asyncio.client import connect

    out: dict[str, list[float]] = {"client": [], "server": [], "errors": [], "cancelled": [], "transcript": []}
    async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, compression=None,
                       max_size=None) as ws:
        json.loads(await ws.recv())
        if not bare:
            await ws.send(json.dumps({"type": "session.update", "session": {"input_audio_sample_rate": 24_000}}))
        # Each user turn's end (the last voiced chunk sent) is matched to its own response:
        # turn ends queue up and each response.created takes the oldest, so an answer that
        # arrives after the next turn ended (overload) is still timed from its own turn.
        state = {"voiced": 0.0, "done": 0}
        pending: deque[float] = deque()
        heard: deque[float] = deque()  # turn ends waiting for their .completed transcript
        by_resp: dict[str, float] = {}
        finished = asyncio.Event()

        async def reader() -> None:
            async for raw in ws:
                ev = json.loads(raw)
                t = ev["type"]
                if t == "input_audio_buffer.speech_stopped":
                    pending.append(state["voiced"])
                    heard.append(state["voiced"])
                elif t == "conversation.item.input_audio_transcription.completed" and heard:
                    out["transcript"].append((time.perf_counter() - heard.popleft()) * 1000)
                elif t == "response.created" and pending:
                    by_resp[ev["response"]["id"]] = pending.popleft()
                elif t == "response.audio.delta":
                    rid = ev.get("response_id")
                    eos = (pending.popleft() if pending else None) if rid is None else by_resp.pop(rid, None)
                    if eos:
                        out["client"].append((time.perf_counter() - eos) * 1000)
                elif t == "response.done":
                    lat = ev.get("x_tristream", {}).get("latency_ms", {}).get("eos_to_first_audio_ms")
                    if lat is not None:
                        out["server"].append(lat)
                    if ev["response"].get("status") == "cancelled":
                        out["cancelled"].append(1.0)
                    state["done"] += 1
                    if state["done"] >= turns:
                        finished.set()
                elif t == "error":
                    out["errors"].append(1.0)

        rtask = asyncio.get_running_loop().create_task(reader())
        step = 480
        t0 = time.perf_counter()
        for i in range(0, pcm.size, step):
            delay = t0 + i / 24_000 - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            chunk = pcm[i:i + step]
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(chunk.tobytes()).decode()}))
            if np.sqrt(np.mean((chunk.astype(np.float32) / 32768) ** 2)) > 0.02:
                state["voiced"] = time.perf_counter()
        try:
            await asyncio.wait_for(finished.wait(), wait_s)
        except TimeoutError:
            out["errors"].append(1.0)
        rtask.cancel()
    return out


def run_config(n: int, backend: str, pcm: np.ndarray, turns: int, wait_s: float) -> dict[str, object]:
    port = free_port()
    bare = backend == "bare"
    if bare:
        cmd = [sys.executable, __file__, "--bare-server", str(port)]
    else:
        cmd = [sys.executable, "-m", "tristream.cli", "serve", "--port", str(port), "--token", TOKEN,
               "--backend", backend, "--pace", "1", "--max-sessions", str(max(64, n))]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300  # the pipeline loads its models first
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited: rc={proc.poll()}")
            if "ready" in line or "ws://" in line:
                break
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        load0 = os.getloadavg()[0]
        cpu0, w0 = process_cpu_s(proc.pid, children=True), time.perf_counter()

        async def all_clients() -> list[dict[str, list[float]]]:
            return await asyncio.gather(*(one_client(url, pcm, turns, bare, wait_s) for _ in range(n)))

        results = asyncio.run(all_clients())
        cpu1, w1 = process_cpu_s(proc.pid, children=True), time.perf_counter()
    finally:
        stop_process(proc, 15)
    client = np.array([v for r in results for v in r["client"]])
    heard = np.array([v for r in results for v in r["transcript"]])
    server = np.array([v for r in results for v in r["server"]])
    wall = w1 - w0

    def pct(a: np.ndarray, q: float) -> float | None:
        return round(float(np.percentile(a, q)), 2) if a.size else None

    return {
        "backend": backend, "clients": n, "turns_expected": n * turns, "turns_measured": int(client.size),
        "errors": int(sum(len(r["errors"]) for r in results)),
        "responses_cancelled_by_barge_in": int(sum(len(r["cancelled"]) for r in results)),
        "eos_to_first_audio_client_ms": {"p50": pct(client, 50), "p99": pct(client, 99), "max": pct(client, 100)},
        "eos_to_first_audio_server_ms": {"p50": pct(server, 50), "p99": pct(server, 99)},
        "eos_to_transcript_client_ms": {"p50": pct(heard, 50), "p99": pct(heard, 99)},
        "wall_s": round(wall, 2),
        "server_cpu_s": round(cpu1 - cpu0, 3),
        "server_cpu_per_session_pct": round(100 * (cpu1 - cpu0) / (n * wall), 3),
        # Per second of user audio: not diluted by the wait for late answers at the end.
        "server_cpu_pct_per_session_audio_s": round(100 * (cpu1 - cpu0) / (n * pcm.size / 24_000), 3),
        "loadavg_1m_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


# ------------------------------------------------------------------ engine backend (text turns)

TIERS = ("gold", "silver", "bronze")


def start_server(backend: str, n_max: int) -> tuple[subprocess.Popen[str], int]:
    """`tristream serve` in its own process; returns it once it listens (models loaded)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tristream.cli", "serve", "--port", str(port), "--token", TOKEN,
           "--backend", backend, "--max-sessions", str(max(64, n_max)), "--max-messages-per-s", "1000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 600
    tail: deque[str] = deque(maxlen=20)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server exited: rc={proc.poll()}\n" + "".join(tail))
        tail.append(line)
        if "ws://" in line:
            return proc, port
    proc.kill()
    raise RuntimeError("server did not start in 600 s")


async def text_client(url: str, k: int, turns: int, think_s: float, words: int) -> dict[str, Any]:
    """One client's text turns; latencies in ms, sheds and errors counted."""
    from websockets.asyncio.client import connect

    rng = np.random.default_rng(k)
    tier = TIERS[k % len(TIERS)]
    out: dict[str, Any] = {"tier": tier, "client": [], "server": [], "shed": [], "errors": 0, "tokens": 0}
    async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, compression=None,
                       max_size=None) as ws:
        json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "session.update", "session": {"modalities": ["text"], "tier": tier}}))
        json.loads(await ws.recv())
        for turn in range(turns):
            await asyncio.sleep(float(rng.uniform(0, think_s)))
            text = " ".join(f"w{int(x)}" for x in rng.integers(0, 1000, words)) + f" (client {k} turn {turn})"
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "response.create"}))
            first = None
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 120))
                t = ev["type"]
                if t == "response.text.delta":
                    out["tokens"] += 1
                    if first is None:
                        first = (time.perf_counter() - t0) * 1000
                        out["client"].append(first)
                elif t == "error":
                    if ev["error"]["code"] == "scheduler_shed":
                        out["shed"].append((time.perf_counter() - t0) * 1000)
                    elif ev["error"]["code"] != "conversation_already_has_active_response":
                        out["errors"] += 1
                elif t == "response.done":
                    lat = ev.get("x_tristream", {}).get("latency_ms", {}).get("eos_to_first_text_ms")
                    if lat is not None and ev["response"]["status"] == "completed":
                        out["server"].append(lat)
                    break
    return out


def pct(a: list[float], q: float) -> float | None:
    return round(float(np.percentile(np.array(a), q)), 2) if a else None


def run_engine_variant(backend: str, label: str, clients: list[int], turns: int, think_s: float,
                       words: int) -> list[dict[str, Any]]:
    proc, port = start_server(backend, max(clients))
    url = f"ws://127.0.0.1:{port}/v1/realtime"
    rows = []
    try:
        async def warm_up() -> None:
            await asyncio.gather(*(text_client(url, k, 1, 0.0, words) for k in range(4)))

        asyncio.run(warm_up())
        for n in clients:
            cpu0, w0 = process_cpu_s(proc.pid, children=True), time.perf_counter()

            async def all_clients(n: int = n) -> list[dict[str, Any]]:
                return await asyncio.gather(*(text_client(url, k, turns, think_s, words) for k in range(n)))

            res = asyncio.run(all_clients())
            cpu1, wall = process_cpu_s(proc.pid, children=True), time.perf_counter() - w0
            client = [v for r in res for v in r["client"]]
            server = [v for r in res for v in r["server"]]
            shed = [v for r in res for v in r["shed"]]
            row: dict[str, Any] = {
                "variant": label, "backend": backend, "clients": n, "turns_expected": n * turns,
                "turns_answered": len(client), "turns_shed": len(shed),
                "errors": sum(r["errors"] for r in res), "tokens": sum(r["tokens"] for r in res),
                "first_text_client_ms": {"p50": pct(client, 50), "p99": pct(client, 99), "max": pct(client, 100)},
                "first_text_server_ms": {"p50": pct(server, 50), "p99": pct(server, 99)},
                "first_text_client_p99_by_tier_ms": {t: pct([v for r in res if r["tier"] == t for v in r["client"]], 99)
                                                     for t in TIERS},
                "shed_to_client_ms": {"p50": pct(shed, 50), "p99": pct(shed, 99), "max": pct(shed, 100)},
                "wall_s": round(wall, 2), "server_cpu_s": round(cpu1 - cpu0, 3),
                "server_cpu_per_session_pct": round(100 * (cpu1 - cpu0) / (n * wall), 3),
                "loadavg_1m_after": round(os.getloadavg()[0], 2),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop_process(proc, 15)
    return rows


def engine_main(args: argparse.Namespace) -> None:
    from _common import write_results
    from rich.console import Console
    from rich.table import Table

    spec = f"engine:device={args.device},model={args.model},max_tokens={args.max_tokens}"
    rows: list[dict[str, Any]] = []
    variants = [("ours", f"{spec},sched=ours")]
    if not args.no_baseline:
        variants += [("fifo", f"{spec},sched=fifo"), ("none (engine batching, no scheduler)", f"{spec},sched=none")]
    for label, backend in variants:
        rows += run_engine_variant(backend, label, args.clients, args.turns, args.think_s, args.words)
    if not args.no_shed_probe:
        rows += run_engine_variant(f"{spec},sched=ours,turn_timeout_ms=-1", "shed probe (ours, silver/bronze "
                                   "turns timed out)", [min(8, max(args.clients))], 3, 0.2, args.words)
    table = Table(title=f"serve --backend engine ({args.device}, {args.model}): response.create -> first text "
                        f"over loopback, {args.turns} turns per client, {args.max_tokens}-token answers")
    for col in ("variant", "clients", "answered", "shed", "errors", "client P50 ms", "client P99 ms",
                "server P50 ms", "server P99 ms", "shed->client P99 ms", "CPU/session %"):
        table.add_column(col)
    for r in rows:
        c, s, sh = r["first_text_client_ms"], r["first_text_server_ms"], r["shed_to_client_ms"]
        table.add_row(r["variant"], str(r["clients"]), f"{r['turns_answered']}/{r['turns_expected']}",
                      str(r["turns_shed"]), str(r["errors"]), str(c["p50"]), str(c["p99"]), str(s["p50"]),
                      str(s["p99"]), str(sh["p99"]), str(r["server_cpu_per_session_pct"]))
    Console(width=180).print(table)
    path = write_results(f"serve_engine_{args.device.split(':')[0]}", {
        "device": args.device, "model": args.model, "max_tokens": args.max_tokens, "turns_per_client": args.turns,
        "think_s": args.think_s, "prompt_words": args.words, "rows": rows}, extra_modules=("websockets",))
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="echo",
                    choices=("echo", "assistant", "assistant:sched=ours", "assistant:sched=none", "pipeline",
                             "engine", "speech"))
    ap.add_argument("--clients", type=int, nargs="+", default=None, help="default 1 8 32 (engine: 1 8 32 64)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--device", default="cuda", help="engine: cuda or cpu")
    ap.add_argument("--model", default=None, help="engine: preset (random weights), smollm2, or a path")
    ap.add_argument("--max-tokens", type=int, default=32, help="engine: answer length")
    ap.add_argument("--think-s", type=float, default=1.0, help="engine: random pause before each turn")
    ap.add_argument("--words", type=int, default=40, help="engine: words per question")
    ap.add_argument("--no-shed-probe", action="store_true")
    ap.add_argument("--bare-server", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_server:
        asyncio.run(bare_server(args.bare_server))
        return
    if args.backend == "engine":
        args.clients = args.clients or [1, 8, 32, 64]
        args.model = args.model or ("llama-3.2-1b" if args.device.startswith("cuda") else "tiny-random")
        engine_main(args)
        return
    if args.backend == "speech":
        speech_main(args)
        return
    args.clients = args.clients or [1, 8, 32]
    from _common import write_results

    pipeline = args.backend.split(":")[0] in ("assistant", "pipeline")  # the same backend (the server's default)
    pcm = real_speech(args.turns, gap_s=4.0) if pipeline else speech_like(args.turns)
    wait_s = 120.0 if pipeline else 30.0
    rows = []
    for n in args.clients:
        for backend in ([] if args.no_baseline else ["bare"]) + [args.backend]:
            r = run_config(n, backend, pcm, args.turns, wait_s)
            rows.append(r)
            print(json.dumps(r), flush=True)
    print_latencies(f"serve: end of speech -> first audio over loopback ({len(pcm) / 24000:.1f} s of audio "
                    f"per client, {args.turns} turns; includes the 300 ms VAD hangover)", rows,
                    ("server", "backend"), ("client {} ms", "eos_to_first_audio_client_ms"),
                    ("server {} ms", "eos_to_first_audio_server_ms"))
    name = "serve" if not pipeline else "serve_pipeline"
    path = write_results(name, {"backend": args.backend, "rows": rows, "audio_s_per_client": round(len(pcm) / 24000, 2),
                                   "turns_per_client": args.turns}, extra_modules=("websockets", "mcap"))
    print(f"wrote {path}")


def print_latencies(title: str, rows: list[dict[str, Any]], label: tuple[str, str], *latencies: tuple[str, str]) -> None:
    """One table row per run: its label (column name, row key), clients, turns, errors, P50 and P99
    of each latency (column name with ``{}`` for P50/P99, row key), the server's CPU per session."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = [label[0], "clients", "turns", "errors"]
    cols += [name.format(p) for name, _ in latencies for p in ("P50", "P99")]
    for col in (*cols, "server CPU/session %"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r[label[1]]), str(r["clients"]), f"{r['turns_measured']}/{r['turns_expected']}",
                      str(r["errors"]), *(str(r[key][p]) for _, key in latencies for p in ("p50", "p99")),
                      str(r["server_cpu_per_session_pct"]))
    Console(width=160).print(table)


def speech_main(args: argparse.Namespace) -> None:
    """Spoken turns, ``engine`` backend: the CPU speech stages (faster-whisper per utterance, the peer)
    vs ``stages=gpu`` (our batched streaming Whisper on ``--device``), same clients, same speech."""
    from _common import write_results

    clients = args.clients or [1, 8]
    model = args.model or ("llama-3.2-1b" if args.device.startswith("cuda") else "tiny-random")
    pcm = real_speech(args.turns, gap_s=4.0)
    variants = [("embedded", f"engine:device={args.device},model={model},stages=embedded,max_tokens={args.max_tokens}"),
                ("gpu", f"engine:device={args.device},model={model},stages=gpu,max_tokens={args.max_tokens}")]
    rows = []
    for n in clients:
        for label, backend in variants:
            r = {"variant": label, **run_config(n, backend, pcm, args.turns, 120.0)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    print_latencies(f"serve --backend engine, spoken turns ({args.device}): end of speech -> transcript / "
                    "first audio on the client (includes the 300 ms VAD hangover)", rows,
                    ("ASR stages", "variant"), ("transcript {}", "eos_to_transcript_client_ms"),
                    ("audio {}", "eos_to_first_audio_client_ms"))
    path = write_results(f"serve_speech_{args.device.split(':')[0]}", {
        "variants": {k: v for k, v in variants}, "rows": rows, "audio_s_per_client": round(len(pcm) / 24000, 2),
        "turns_per_client": args.turns}, extra_modules=("websockets", "faster_whisper", "ctranslate2"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
