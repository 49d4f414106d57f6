"""CPU time per answered turn of each process on the Ray Serve path (proxy, ingress, replica).

Runs the Ray app with one replica of the engine backend (tiny random model on the CPU by
default), drives N client sessions of text turns (16-token answers: ~23 server frames per
turn) and reads every Ray process's CPU time before and after. Shows where the relay's cost
sits: which process saturates first when sessions are added. Each ``--ingress`` kind is run in
turn in the same Ray cluster (``proxy``: Serve's HTTP proxy in the path; ``direct``: the
ingress listens itself, the proxy idles), with ``--ingress-replicas`` ingress processes.
``relay_calls_per_turn`` counts the replica's relay calls (push/poll) per answered turn, from
its ``tristream_replica_relay_calls_total``; ``frames_per_poll`` the events each poll carried.

    .venv/bin/python bench/scale_profile.py                 # writes bench/results/scale_profile_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def snapshot() -> dict[tuple[int, str], float]:
    """CPU seconds of every Ray worker process of this run's cluster (descendants of this driver:
    another Ray cluster on the machine, e.g. a test run, is not counted)."""
    import psutil

    out: dict[tuple[int, str], float] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if cmd.startswith("ray::"):
                t = p.cpu_times()
                out[(p.pid, cmd.split()[0].split(".")[0])] = t.user + t.system
        except (psutil.Error, OSError):
            continue
    return out


ROLES = {"ray::ProxyActor": "proxy", "ray::EngineReplica": "replica"}


def by_role(ms: dict[str, float]) -> dict[str, float]:
    """CPU ms per turn summed per role: proxy, ingress (every ingress process), router, replica."""
    out = {"proxy": 0.0, "ingress": 0.0, "router": 0.0, "replica": 0.0}
    for name, v in ms.items():
        role = ROLES.get(name) or ("ingress" if name.endswith("tristream_ingress") else
                                   "router" if name.endswith("tristream_router") else None)
        if role is not None:
            out[role] += v
    return {k: round(v, 2) for k, v in out.items()}


def baseline(a: argparse.Namespace, rep: int) -> list[dict[str, Any]]:
    """The same load on `tristream serve` (one process): its CPU per turn is the floor."""
    import json

    import psutil
    import scale

    rows = []
    port = scale.free_port()
    proc = scale.start_direct("tristream.scale.engine_backend:engine_factory", json.loads(a.backend_kw), port)
    try:
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        p = psutil.Process(proc.pid)
        scale.load(url, 2, 2.0, 0.1)  # warm-up
        for n in a.sessions:
            c0 = sum(p.cpu_times()[:2])
            row = scale.load(url, n, a.duration, 0.5, procs=2)
            ms = 1e3 * (sum(p.cpu_times()[:2]) - c0) / max(1, row["turns"])
            rows.append({"config": "tristream serve", "repeat": rep, "sessions": n, "turns": row["turns"],
                         "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"], "n_errors": row["n_errors"],
                         "cpu_ms_per_turn_by_role": {"server": round(ms, 2)}})
            print(f"{'serve':<14} {n:>3} sessions p50={row['p50_ms']:.1f} p99={row['p99_ms']:.1f} ms  "
                  f"cpu ms/turn {ms:.2f}")
    finally:
        proc.terminate()
        proc.wait(10)
    return rows


def relay_calls(base: str) -> dict[str, float]:
    """The replicas' relay call counters by method (and ``events``: frames carried by poll_many)."""
    import urllib.request

    from tristream.scale.prom import parse_samples

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        samples = parse_samples(r.read().decode())
    out: dict[str, float] = {}
    for (name, labels), v in samples.items():
        if name == "tristream_replica_relay_calls_total":
            key = dict(labels).get("method", "?")
            out[key] = out.get(key, 0.0) + v
        elif name == "tristream_replica_relay_events_total":
            out["events"] = out.get("events", 0.0) + v
        elif name in ("tristream_replica_relay_records_total", "tristream_replica_relay_writes_total"):
            key = "socket_" + name.split("_")[-2]
            out[key] = out.get(key, 0.0) + v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--backend-kw", default='{"model": "tiny-random", "device": "cpu", "kv_bytes": 67108864}')
    ap.add_argument("--configs", nargs="+", default=["proxy/ray", "direct/ray", "direct/socket", "proxy/socket"],
                    help="ingress/relay pairs to run in turn: ingress direct|proxy, relay socket|ray")
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the same load on `tristream serve` (RealtimeServer, one process)")
    ap.add_argument("--ingress-replicas", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="run the whole ladder this many times per ingress")
    ap.add_argument("--name", default="scale_profile_cpu")
    a = ap.parse_args()
    import json

    import ray
    import scale
    from _common import write_results
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = scale.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    res: dict[str, Any] = {"backend": "tristream.scale.engine_backend:engine_factory", "backend_kw": a.backend_kw,
                           "ingress_replicas": a.ingress_replicas, "rows": []}
    try:
        for rep in range(a.repeats):
            if a.baseline:
                res["rows"] += baseline(a, rep)
            for cfg in a.configs:
                kind, _, relay = cfg.partition("/")
                url = scale.deploy(port, 1, res["backend"], json.loads(a.backend_kw), 0.0, 0.5, 50.0, kind,
                                   a.ingress_replicas, relay or "socket")
                base = url.replace("ws://", "http://").removesuffix("/v1/realtime")
                scale.load(url, 2, 2.0, 0.1)  # warm-up
                for n in a.sessions:
                    before, calls0, t0 = snapshot(), relay_calls(base), time.time()
                    row = scale.load(url, n, a.duration, 0.5, procs=2)
                    after, calls1, dt = snapshot(), relay_calls(base), time.time() - t0
                    procs: dict[str, float] = {}
                    for k, v in after.items():
                        procs[k[1]] = procs.get(k[1], 0.0) + v - before.get(k, 0.0)
                    turns = max(1, row["turns"])
                    calls = {k: v - calls0.get(k, 0.0) for k, v in calls1.items()}
                    polls = calls.get("poll_many", 0.0) + calls.get("poll", 0.0)
                    res["rows"].append({
                        "config": cfg, "repeat": rep, "sessions": n, "turns": row["turns"], "p50_ms": row["p50_ms"],
                        "p99_ms": row["p99_ms"], "n_errors": row["n_errors"],
                        "cpu_ms_per_turn": {k: round(1e3 * v / turns, 2) for k, v in procs.items() if v > 0.05},
                        "cpu_ms_per_turn_by_role": by_role({k: 1e3 * v / turns for k, v in procs.items()}),
                        "cpu_share": {k: round(v / dt, 3) for k, v in procs.items() if v > 0.05},
                        "relay_calls_per_turn": {k: round(v / turns, 2) for k, v in calls.items()
                                                 if k != "events" and not k.startswith("socket")},
                        "frames_per_poll": round(calls.get("events", 0.0) / polls, 2) if polls else None,
                        "socket_records_per_write": round(calls.get("socket_records", 0.0) / calls["socket_writes"], 2)
                        if calls.get("socket_writes") else None})
                    r = res["rows"][-1]
                    print(f"{cfg:<14} {n:>3} sessions p50={row['p50_ms']:.1f} p99={row['p99_ms']:.1f} ms  "
                          f"cpu ms/turn {r['cpu_ms_per_turn_by_role']}  calls/turn {r['relay_calls_per_turn']}  "
                          f"frames/poll {r['frames_per_poll']} records/write {r['socket_records_per_write']}")
    finally:
        serve.shutdown()
        ray.shutdown()
    write_results(a.name, res)


if __name__ == "__main__":
    main()
