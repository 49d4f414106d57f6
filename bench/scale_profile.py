"""CPU time per answered turn of each process on the Ray Serve path (proxy, ingress, replica).

Runs the Ray app with one replica of the engine backend (tiny random model on the CPU by
default), drives N client sessions of text turns (16-token answers: ~23 server frames per
turn) and reads every Ray process's CPU time before and after. Shows where the relay's cost
sits: which process saturates first when sessions are added.

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
    import psutil

    out: dict[tuple[int, str], float] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if cmd.startswith("ray::"):
                t = p.cpu_times()
                out[(p.pid, cmd.split()[0].split(".")[0])] = t.user + t.system
        except (psutil.Error, OSError):
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--backend-kw", default='{"model": "tiny-random", "device": "cpu", "kv_bytes": 67108864}')
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
                           "rows": []}
    try:
        url = scale.deploy(port, 1, res["backend"], json.loads(a.backend_kw), 0.0, 0.5, 50.0)
        scale.load(url, 2, 2.0, 0.1)  # warm-up
        for n in a.sessions:
            before, t0 = snapshot(), time.time()
            row = scale.load(url, n, a.duration, 0.5, procs=2)
            after, dt = snapshot(), time.time() - t0
            procs: dict[str, float] = {}
            for k, v in after.items():
                procs[k[1]] = procs.get(k[1], 0.0) + v - before.get(k, 0.0)
            turns = max(1, row["turns"])
            res["rows"].append({"sessions": n, "turns": row["turns"], "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"],
                                "cpu_ms_per_turn": {k: round(1e3 * v / turns, 2) for k, v in procs.items() if v > 0.05},
                                "cpu_share": {k: round(v / dt, 3) for k, v in procs.items() if v > 0.05}})
            print(n, "sessions:", res["rows"][-1]["cpu_ms_per_turn"])
    finally:
        serve.shutdown()
        ray.shutdown()
    write_results(a.name, res)


if __name__ == "__main__":
    main()
