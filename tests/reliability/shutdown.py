"""Graceful shutdown under load (issue 9 item 11), shared by the test and `bench/reliability.py`.

`tristream serve` runs as a real process; clients stream turns and wait for answers; the
process gets SIGTERM mid-answer. Recorded: what each client saw (answer finished or
`server_shutting_down` error), its close code, whether a new connection was refused during
the drain, how long the drain took and the exit code.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

ROOT = Path(__file__).resolve().parents[2]


def raise_nofile_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # not allowed here: the caller reports the limit it got
    return int(soft)


def start_server(token: str, pace: float = 1.0, max_sessions: int = 64,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen[str], int]:
    """`tristream serve --backend echo` on a free port (plus `extra` options); returns the process and its port."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # The server logs a line per connection at INFO: its stderr goes to a file, never to a pipe
    # nobody reads (a full 64 KiB pipe blocks the server's event loop: that hung the 10,000
    # idle-connection run after ~1,000 connections).
    log = tempfile.NamedTemporaryFile("w+", prefix="tristream-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-c", "from tristream.cli import main; main()", "serve", "--port", "0",
                             "--token", token, "--backend", "echo", "--pace", str(pace), "--max-sessions", str(max_sessions),
                             *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                            preexec_fn=raise_nofile_limit)
    log.close()
    proc.log_path = log.name  # type: ignore[attr-defined]
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ws://"):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r} {Path(log.name).read_text()[-4000:]}")
    port = int(line.split()[0].rsplit(":", 1)[1].split("/")[0])
    return proc, port


async def _client(u: str, token: str, answering: asyncio.Event, out: dict[str, Any]) -> None:
    rate = 24_000
    t = np.arange(rate * 800 // 1000) / rate
    voiced = (np.sin(2 * np.pi * 300 * t) * 5000).astype(np.int16)
    audio = np.concatenate([voiced, np.zeros(rate * 500 // 1000, np.int16)])
    try:
        async with connect(u, additional_headers={"Authorization": f"Bearer {token}"}) as ws:
            await ws.recv()
            for i in range(0, audio.size, 4800):
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(audio[i:i + 4800].tobytes()).decode()}))
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if ev["type"] == "response.audio.delta":
                    answering.set()
                if ev["type"] == "error":
                    out["error"] = ev["error"]["code"]
                    out["error_at"] = time.monotonic()
                if ev["type"] == "response.done":
                    out["status"] = ev["response"]["status"]
                    out["done_at"] = time.monotonic()
    except ConnectionClosed as exc:
        out["close_code"] = exc.rcvd.code if exc.rcvd is not None else None
        out["closed_at"] = time.monotonic()


async def shutdown_under_load(token: str, sessions: int = 20, pace: float = 1.0) -> dict[str, Any]:
    """See the module docstring."""
    proc, port = start_server(token, pace)
    u = f"ws://127.0.0.1:{port}/v1/realtime"
    try:
        outs: list[dict[str, Any]] = [{} for _ in range(sessions)]
        answering = asyncio.Event()
        tasks = [asyncio.ensure_future(_client(u, token, answering, outs[i])) for i in range(sessions)]
        await asyncio.wait_for(answering.wait(), 30)
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)  # let the signal land; then a newcomer must be turned away
        newcomer: Any
        try:
            async with connect(u, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=5):
                newcomer = 101
        except InvalidStatus as e:
            newcomer = e.response.status_code
        except OSError as e:
            newcomer = type(e).__name__
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        rc = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60)
        t_exit = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
    return {
        "sessions": sessions, "exit_code": rc, "drain_s": t_exit - t_term, "newcomer": newcomer,
        "close_codes": sorted({o.get("close_code") for o in outs}, key=str),
        "finished": sum(o.get("status") == "completed" for o in outs),
        "told_shutting_down": sum(o.get("error") == "server_shutting_down" for o in outs),
        "unanswered": sum(1 for o in outs if o.get("status") is None and o.get("error") is None),
        "max_close_after_term_s": max((o.get("closed_at", t_exit) - t_term for o in outs), default=0.0),
    }
