"""Replica death on Ray under load (issue 9 item 9), shared by the test and `bench/reliability.py`.

A local Ray cluster (CPU) runs the Ray Serve app with 2 echo replicas (real-time paced
answers, so answers are in flight). ``sessions`` clients loop text turns; once every one of
them is mid-answer, ``ray.kill`` takes one replica down. Recorded: what each session on the
killed replica saw (``error`` event code, close code, time from the kill), whether any session
on the other replica saw anything but exact answers, and how long after the kill a new session
is placed on a live replica and answered, and the pool is back to 2 replicas.

It runs in its own process (``python -m tests.reliability.ray_death``, one JSON line out) so
its Ray cluster and Serve instance never meet the session-scoped ones of ``tests/scale``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.serve.helpers import TOKEN

ROOT = Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class SessionLog:
    """What one client saw."""

    sid: str = ""
    replica: str = ""
    turns_ok: int = 0
    wrong_answers: int = 0
    answering: bool = False
    errors: list[str] = field(default_factory=list)
    error_at: float | None = None
    close_code: int | None = None
    closed_at: float | None = None


async def _turn(ws: Any, text: str, log: SessionLog) -> bool:
    """One text turn; False when the session ended (error event or closed socket)."""
    await ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
    await ws.send(json.dumps({"type": "response.create"}))
    got: list[str] = []
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
        if ev["type"] == "response.audio_transcript.delta":
            got.append(ev["delta"])
            log.answering = True
        elif ev["type"] == "error":
            log.errors.append(ev["error"]["code"])
            log.error_at = time.monotonic()
            return False
        elif ev["type"] == "response.done":
            log.answering = False
            ok = ev["response"]["status"] == "completed" and "".join(got) == f"echo: {text}"
            log.turns_ok += ok
            log.wrong_answers += not ok
            return True


async def _session(url: str, i: int, log: SessionLog, stop: asyncio.Event, words: int) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    try:
        async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, open_timeout=60,
                           ping_interval=None) as ws:
            log.sid = json.loads(await ws.recv())["session"]["id"]
            k = 0
            try:
                while not stop.is_set():
                    text = " ".join(f"s{i}t{k}w{j}" for j in range(words))
                    if not await _turn(ws, text, log):
                        await asyncio.wait_for(ws.recv(), 30)  # the close must follow the error
                    k += 1
            except ConnectionClosed as exc:
                log.close_code = exc.rcvd.code if exc.rcvd is not None else None
                log.closed_at = time.monotonic()
                return
        log.close_code = 1000  # we closed it, normally
    except ConnectionClosed as exc:
        log.close_code = exc.rcvd.code if exc.rcvd is not None else None
        log.closed_at = time.monotonic()


async def _scenario(app: Any, sessions: int, words: int, after_s: float) -> dict[str, Any]:
    import ray
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    from tristream.scale.pool import E_REPLICA_FAILED, NAMESPACE

    def placement() -> dict[str, Any]:
        status, body = app.get("/scale/placement")
        if status != 200:
            raise RuntimeError(f"/scale/placement answered {status}: {body}")
        return dict(json.loads(body))

    stop = asyncio.Event()
    logs = [SessionLog() for _ in range(sessions)]
    tasks = [asyncio.ensure_future(_session(app.url, i, logs[i], stop, words)) for i in range(sessions)]
    loop = asyncio.get_running_loop()
    t_wait = loop.time()
    while not all(lg.answering for lg in logs):  # every session has an answer in flight
        if loop.time() - t_wait > 60:
            raise TimeoutError("the sessions never all had an answer in flight")
        await asyncio.sleep(0.01)
    where = placement()["placement"]
    for lg in logs:
        lg.replica = where.get(lg.sid, "?")
    victim = logs[0].replica
    ok_at_kill = [lg.turns_ok for lg in logs]
    t_kill = time.monotonic()
    ray.kill(ray.get_actor(victim, namespace=NAMESPACE))

    # New sessions: the first that is placed and answered, timed from the kill.
    routed_s: float | None = None
    routed_to = ""
    attempts: dict[str, int] = {}
    while routed_s is None and time.monotonic() - t_kill < 60:
        try:
            async with connect(app.url, additional_headers={"Authorization": f"Bearer {TOKEN}"},
                               open_timeout=30, ping_interval=None) as ws:
                sid = json.loads(await ws.recv())["session"]["id"]
                probe = SessionLog()
                if await _turn(ws, "probe after the kill", probe) and probe.turns_ok == 1:
                    routed_s = time.monotonic() - t_kill
                    routed_to = placement()["placement"].get(sid, "?")
                attempts["answered" if probe.turns_ok else "error_event"] = attempts.get(
                    "answered" if probe.turns_ok else "error_event", 0) + 1
        except InvalidStatus as e:
            key = f"http_{e.response.status_code}"
            attempts[key] = attempts.get(key, 0) + 1
            await asyncio.sleep(0.1)
        except Exception as exc:  # counted, never dropped
            attempts[type(exc).__name__] = attempts.get(type(exc).__name__, 0) + 1
            await asyncio.sleep(0.1)
    refill_s: float | None = None
    while time.monotonic() - t_kill < 90:
        if len(placement()["replicas"]) >= 2:
            refill_s = time.monotonic() - t_kill
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(max(0.0, after_s - (time.monotonic() - t_kill)))  # survivors keep talking
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 120)

    if any(lg.replica == "?" for lg in logs):
        raise RuntimeError("a session was missing from /scale/placement before the kill")
    hit = [lg for lg in logs if lg.replica == victim]
    rest = [lg for lg in logs if lg.replica != victim]
    err_times = [lg.error_at - t_kill for lg in hit if lg.error_at is not None]
    close_times = [lg.closed_at - t_kill for lg in hit if lg.closed_at is not None]
    return {
        "sessions": sessions, "replicas": 2, "backend": "echo (real-time paced)", "words_per_turn": words,
        "victim_sessions": len(hit), "other_sessions": len(rest),
        "victim_sessions_with_error_event": sum(bool(lg.errors) for lg in hit),
        "victim_error_codes": sorted({c for lg in hit for c in lg.errors}),
        "victim_error_code_is_replica_failed": all(lg.errors == [E_REPLICA_FAILED] for lg in hit),
        "victim_close_codes": sorted({str(lg.close_code) for lg in hit}),
        "victim_time_to_error_s_max": max(err_times) if err_times else None,
        "victim_time_to_close_s_max": max(close_times) if close_times else None,
        "other_sessions_affected": sum(bool(lg.errors) or lg.wrong_answers > 0 or lg.close_code != 1000
                                       for lg in rest),
        "other_sessions_turns_completed": sum(lg.turns_ok for lg in rest),
        "other_sessions_turns_completed_after_kill_min": min(
            (lg.turns_ok - ok_at_kill[i] for i, lg in enumerate(logs) if lg.replica != victim), default=0),
        "other_close_codes": sorted({str(lg.close_code) for lg in rest}),
        "new_session_routed_and_answered_s": routed_s, "new_session_replica_is_live": bool(routed_to) and
        routed_to != victim, "new_session_attempts": attempts,
        "pool_back_to_2_replicas_s": refill_s,
    }


def run_local(sessions: int = 8, words: int = 20, after_s: float = 3.0, pace: float = 1.0) -> dict[str, Any]:
    """Start Ray + Serve here, deploy 2 echo replicas, run the scenario, shut everything down."""
    import ray
    from ray import serve

    from tests.scale.conftest import deploy, free_port

    t0 = time.monotonic()
    ray.init(num_cpus=4, object_store_memory=128 << 20, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = deploy(port, "reliability", backend="echo", replicas=2, backend_kw={"pace": pace})
        t_ready = time.monotonic() - t0
        res = asyncio.run(_scenario(app, sessions, words, after_s))
        res["ray_version"] = ray.__version__
        res["startup_s"] = t_ready
        return res
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def run_subprocess(sessions: int = 8, words: int = 20, after_s: float = 3.0, timeout_s: float = 300) -> dict[str, Any]:
    """`run_local` in a fresh interpreter (its own Ray cluster); returns its JSON result."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "tests.reliability.ray_death", "--sessions", str(sessions),
                        "--words", str(words), "--after-s", str(after_s)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"ray_death exited {p.returncode}: {p.stderr[-3000:]}")
    return dict(json.loads(lines[-1]))


def main() -> None:
    """CLI: run the scenario once and print one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--words", type=int, default=20)
    ap.add_argument("--after-s", type=float, default=3.0)
    a = ap.parse_args()
    print(json.dumps(run_local(a.sessions, a.words, a.after_s)), flush=True)


if __name__ == "__main__":
    main()
