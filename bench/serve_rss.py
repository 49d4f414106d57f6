"""Server RSS after sessions close: does `tristream serve` give memory back? (docs/serve-memory.md)

Starts ``tristream serve --backend echo --pace 0`` as a subprocess and drives it with real
WebSocket clients. Each session: connect, ``session.update``, one voiced turn of audio appends
(server VAD, echo answer with audio), one text turn (``conversation.item.create`` +
``response.create``). Two modes, one server process each:

- ``churn``: sessions one after another on ``--clients`` connections at a time; the server's
  VmRSS (/proc/PID/status) after each cumulative count of ``--sessions``;
- ``waves``: each count of ``--sessions`` open at once (connected 100 at a time), then all
  closed; RSS with them open and ``--settle-s`` after they closed.

Both end with ``--idle-s`` of idleness. The table goes to stdout and, with the server's CPU
seconds, to ``bench/results/<--out>.json``.

``--probe`` runs the same CLI under a wrapper (``--server-child``) that answers SIGUSR1 with a
JSON line in ``--probe-file``: RSS, tracked Python objects by type before a collection (garbage
in reference cycles included) and what ``gc.collect()`` then finds, 1 MiB address regions that
hold live GC-tracked objects, pymalloc arenas (``sys._debugmallocstats``), glibc's ``mallinfo2``,
the server's table sizes and trims, and with ``--tracemalloc`` the growth since the first probe
by traceback. After the idle reading it sends SIGUSR2: the same plus RSS before/after a
``malloc_trim(0)``. ``--no-turn-history`` (with ``--probe``) keeps no turn timings or spans:
the experiment that shows the bounded turn history is a small part of what stays mapped.
It is a diagnostic, not part of the server.

    python bench/serve_rss.py                                   # churn and waves of 2k/5k/10k
    python bench/serve_rss.py --server-env TRISTREAM_MEMORY_TRIM_S=0 --variant trim_off          # heap trim off
    python bench/serve_rss.py --server-env PYTHONMALLOC=malloc --variant pythonmalloc_waves_collect
    python bench/serve_rss.py --mode waves --sessions 2000 --probe --variant probe   # where the memory is

Each run with ``--variant`` is kept under ``variants`` of `bench/results/serve_rss.json`, beside
the default run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RATE = 24_000
CHUNK = RATE // 10  # 100 ms appends
PER_SESSION_TYPES = ("RealtimeSession", "EchoBackend", "_Conn", "ServerConnection", "ServerProtocol",
                     "_SelectorSocketTransport", "Task", "Future", "coroutine")


def vm_rss_mb(pid: int) -> float:
    """VmRSS of a process in MB (`bench.soak.proc_stats`)."""
    from bench.soak import proc_stats

    return proc_stats(pid)["rss_mb"]


# ------------------------------------------------------------------ server side (--server-child)
def _mallinfo() -> dict[str, float] | None:
    """glibc's ``mallinfo2`` (MB): heap held, in use, free, mmapped; None without glibc."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2
    m = fn()
    mb = 1 / 2**20
    return {"heap_mb": m.arena * mb, "in_use_mb": m.uordblks * mb, "free_mb": m.fordblks * mb,
            "mmapped_mb": m.hblkhd * mb, "free_chunks": float(m.ordblks)}


def _pymalloc() -> dict[str, float]:
    """pymalloc arenas (1 MiB each) and blocks, parsed from ``sys._debugmallocstats`` (it writes to fd 2;
    empty when pymalloc is not the allocator, e.g. under PYTHONMALLOC=malloc or tracemalloc)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as tmp:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    keys = {"# arenas allocated current": "arenas", "# arenas highwater mark": "arenas_highwater",
            "# bytes in allocated blocks": "allocated_mb", "# bytes in available blocks": "available_mb"}
    out: dict[str, float] = {}
    for line in text.splitlines():
        for k, name in keys.items():
            if line.startswith(k):
                v = float(line.split("=")[-1].replace(",", "").strip())
                out[name] = v / 2**20 if name.endswith("_mb") else v
    return out


def _probe(out: Path, trim: bool, state: dict[str, Any]) -> None:
    import gc
    import tracemalloc
    from collections import Counter

    rec: dict[str, Any] = {"rss_mb": vm_rss_mb(os.getpid())}
    pending = Counter(type(o).__name__ for o in gc.get_objects())  # unreachable cycles included
    rec["before_collect"] = {k: pending.get(k, 0) for k in PER_SESSION_TYPES}
    rec["before_collect"]["all"] = sum(pending.values())
    del pending
    t0 = time.perf_counter()
    rec["gc_collected"] = gc.collect()
    rec["gc_collect_ms"] = (time.perf_counter() - t0) * 1000
    rec["rss_after_collect_mb"] = vm_rss_mb(os.getpid())
    objs = gc.get_objects()  # not the start-up heap: `tristream serve` freezes it (gc.freeze)
    by_type = Counter(type(o).__name__ for o in objs)
    rec["gc_objects"] = len(objs)
    rec["top_types"] = by_type.most_common(20)
    # 1 MiB address regions (pymalloc's arena size) holding a live GC-tracked object, in all and for
    # the server's bounded turn history: an arena with one live block in it stays mapped
    regions: dict[str, set[int]] = {"all": set(), "TurnTiming": set(), "Span": set()}
    for o in objs:
        regions["all"].add(id(o) >> 20)
        if type(o).__name__ in regions:
            regions[type(o).__name__].add(id(o) >> 20)
    rec["regions_1mib_with_live_gc_objects"] = {k: len(v) for k, v in regions.items()}
    del objs
    srv = state.get("server")
    if srv is not None:
        rec["server"] = {"conns": len(srv.conns), "turns": len(srv.turns), "tracer_spans": len(srv.tracer.spans),
                         "counters": len(srv.metrics.counters), "bg_tasks": len(srv._bg)}
        tr = getattr(srv, "trimmer", None)
        if tr is not None:
            rec["trimmer"] = {"trims": tr.trims, "released_mb": tr.released_bytes / 2**20,
                              "ms": tr.seconds * 1000, "peak": tr.peak}
    rec["mallinfo"] = _mallinfo()
    rec["pymalloc"] = _pymalloc()
    if tracemalloc.is_tracing():
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        rec["tracemalloc_traced_mb"] = tracemalloc.get_traced_memory()[0] / 2**20
        if "snap0" not in state:
            state["snap0"] = snap
        else:
            diff = snap.compare_to(state["snap0"], "traceback")
            rec["tracemalloc_growth"] = [[" <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}"
                                                      for f in reversed(d.traceback)),
                                          round(d.size_diff / 1024, 1), d.count_diff] for d in diff[:25]]
    if trim:
        before = vm_rss_mb(os.getpid())
        from tristream.serve.memtrim import malloc_trim

        t0 = time.perf_counter()
        rec["malloc_trim"] = None if malloc_trim(0) is None else {
            "rss_before_mb": before, "rss_after_mb": vm_rss_mb(os.getpid()),
            "ms": (time.perf_counter() - t0) * 1000, "mallinfo_after": _mallinfo()}
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def server_child(argv: list[str]) -> None:
    """`tristream serve` (argv) with the probe on SIGUSR1 / SIGUSR2 (see the module docstring)."""
    out = Path(os.environ["SERVE_RSS_PROBE"])
    if os.environ.get("SERVE_RSS_TRACEMALLOC"):
        import tracemalloc

        tracemalloc.start(int(os.environ["SERVE_RSS_TRACEMALLOC"]))
    state: dict[str, Any] = {}
    from tristream.serve.server import RealtimeServer

    init = RealtimeServer.__init__

    def keep(self: RealtimeServer, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        state["server"] = self

    RealtimeServer.__init__ = keep  # type: ignore[method-assign]
    if os.environ.get("SERVE_RSS_NO_TURN_HISTORY") == "1":
        RealtimeServer._on_turn = lambda self, sid, t: None  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR1, lambda *_: _probe(out, False, state))
    signal.signal(signal.SIGUSR2, lambda *_: _probe(out, True, state))
    from tristream.cli import app

    app(argv, prog_name="tristream")


# ------------------------------------------------------------------ clients
def _tone(ms: int) -> np.ndarray:
    t = np.arange(RATE * ms // 1000) / RATE
    return (np.sin(2 * np.pi * 300 * t) * 6000).astype("<i2")


_AUDIO = np.concatenate([_tone(300), np.zeros(RATE * 500 // 1000, dtype="<i2")])
_APPENDS = [json.dumps({"type": "input_audio_buffer.append",
                        "audio": base64.b64encode(_AUDIO[i:i + CHUNK].tobytes()).decode()})
            for i in range(0, _AUDIO.size, CHUNK)]


async def open_session(url: str) -> Any:
    """Connect and do one session's exchange (see the module docstring); returns the open client."""
    from tristream.serve.client import RealtimeClient

    c = await RealtimeClient.connect(url, None, open_timeout=120)
    try:
        await c.send({"type": "session.update", "session": {
            "instructions": "be brief", "turn_detection": {"type": "server_vad", "silence_duration_ms": 200}}})
        await _until(c, "session.updated")
        for msg in _APPENDS:
            await c.ws.send(msg)
        await _until(c, "response.done")
        await c.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello there"}]}})
        await c.send({"type": "response.create"})
        await _until(c, "response.done")
    except BaseException:
        await c.close()
        raise
    return c


async def _until(c: Any, kind: str) -> None:
    while True:
        ev = await c.recv(timeout=120)
        if ev["type"] == kind:
            return
        if ev["type"] == "error":
            raise RuntimeError(ev)


def _count(errors: dict[str, int], exc: BaseException) -> None:
    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1


async def churn(url: str, n: int, clients: int, errors: dict[str, int]) -> None:
    """`n` sessions one after another on each of `clients` connections at a time."""
    left = [n]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            try:
                c = await open_session(url)
                await c.close()
            except Exception as exc:  # counted, reported
                _count(errors, exc)

    await asyncio.gather(*(worker() for _ in range(clients)))


async def wave(url: str, n: int, errors: dict[str, int], at_peak: Callable[[], None], batch: int = 100) -> None:
    """`n` sessions open at once (opened `batch` at a time), `at_peak()`, then all closed."""
    conns: list[Any] = []
    for k in range(0, n, batch):
        got = await asyncio.gather(*(open_session(url) for _ in range(min(batch, n - k))), return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException):
                _count(errors, g)
            else:
                conns.append(g)
    at_peak()
    for k in range(0, len(conns), 500):
        await asyncio.gather(*(c.close() for c in conns[k:k + 500]), return_exceptions=True)


# ------------------------------------------------------------------ parent
def start(args: argparse.Namespace, max_sessions: int, probe: Path | None) -> tuple[subprocess.Popen[str], int]:
    """`tristream serve --backend echo` (under the probe wrapper with `probe`); returns it once it listens."""
    from bench._common import free_port

    port = free_port()
    serve = ["serve", "--port", str(port), "--no-auth", "--backend", "echo", "--pace", "0",
             "--max-sessions", str(max_sessions), "--max-messages-per-s", "1000", *args.server_arg]
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in args.server_env)
    if probe is not None:
        cmd = [sys.executable, __file__, "--server-child", *serve]
        env["SERVE_RSS_PROBE"] = str(probe)
        if args.tracemalloc:
            env["SERVE_RSS_TRACEMALLOC"] = str(args.tracemalloc)
        if args.no_turn_history:
            env["SERVE_RSS_NO_TURN_HISTORY"] = "1"
    else:
        cmd = [sys.executable, "-m", "tristream.cli", *serve]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server exited: rc={proc.poll()}")
        if "ws://" in line:
            # keep reading its output: a full pipe would block the server's event loop
            threading.Thread(target=lambda: [None for _ in proc.stdout or ()], daemon=True).start()
            return proc, port
    proc.kill()
    raise RuntimeError("server did not start")


def _probe_now(proc: subprocess.Popen[str], probe: Path, trim: bool = False) -> dict[str, Any]:
    n = len(probe.read_text().splitlines()) if probe.exists() else 0
    os.kill(proc.pid, signal.SIGUSR2 if trim else signal.SIGUSR1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        lines = probe.read_text().splitlines() if probe.exists() else []
        if len(lines) > n:
            rec: dict[str, Any] = json.loads(lines[n])
            return rec
        time.sleep(0.1)
    raise RuntimeError("probe did not answer")


def run(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One server process: churn or waves (see the module docstring), RSS at every step."""
    from bench._common import process_cpu_s

    probe = Path(args.probe_file) if args.probe else None
    if probe is not None and probe.exists():
        probe.unlink()
    counts = args.sessions
    proc, port = start(args, max(64, 2 * args.clients) if mode == "churn" else max(counts) + 64, probe)
    url = f"ws://127.0.0.1:{port}/v1/realtime"
    rows: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    errors: dict[str, int] = {}

    def mark(label: str, sessions: int, trim: bool = False) -> None:
        row: dict[str, Any] = {"point": label, "sessions": sessions, "rss_mb": round(vm_rss_mb(proc.pid), 1),
                               "server_cpu_s": round(process_cpu_s(proc.pid), 2)}
        if probe is not None:
            p = _probe_now(proc, probe, trim)
            p["point"] = label
            probes.append(p)
            row["py_objects_before_collect"] = p["before_collect"]["all"]
            row["gc_collected"] = p["gc_collected"]
            if p.get("pymalloc"):
                row["pymalloc_arenas"] = p["pymalloc"].get("arenas")
            if p.get("mallinfo"):
                row["glibc_free_mb"] = round(p["mallinfo"]["free_mb"], 1)
            if p.get("malloc_trim"):
                row["rss_after_trim_mb"] = round(p["malloc_trim"]["rss_after_mb"], 1)
        rows.append(row)
        print(f"  [{mode}] " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    try:
        time.sleep(1.0)
        mark("start", 0)
        done = 0
        for n in counts:
            if mode == "churn":
                asyncio.run(churn(url, n - done, args.clients, errors))
                done = n
                time.sleep(args.settle_s)
                mark(f"after {n}", done)
            else:
                total = done + n
                asyncio.run(wave(url, n, errors, lambda n=n, total=total: mark(f"{n} open", total)))  # type: ignore[misc]
                done = total
                time.sleep(args.settle_s)
                mark(f"{n} closed", done)
        time.sleep(args.idle_s)
        mark(f"idle {args.idle_s:g}s", done, trim=probe is not None)
    finally:
        from bench._common import stop_process

        stop_process(proc)
    return {"mode": mode, "sessions": counts, "clients": args.clients if mode == "churn" else None,
            "server_args": args.server_arg, "server_env": args.server_env, "client_errors": errors,
            "rows": rows, "probes": probes}


def main() -> None:
    """CLI (see the module docstring)."""
    if len(sys.argv) > 1 and sys.argv[1] == "--server-child":
        server_child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("churn", "waves", "both"), default="both")
    ap.add_argument("--sessions", default="2000,5000,10000",
                    help="churn: cumulative session counts to read RSS at; waves: sessions open at once per wave")
    ap.add_argument("--clients", type=int, default=8, help="churn: concurrent client sessions")
    ap.add_argument("--settle-s", type=float, default=5.0, help="wait after each step before reading RSS")
    ap.add_argument("--idle-s", type=float, default=5.0, help="then idle this long before the last reading")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `tristream serve` argument")
    ap.add_argument("--server-env", action="append", default=[], help="KEY=VALUE for the server process only")
    ap.add_argument("--probe", action="store_true", help="server under the SIGUSR1 probe (see the docstring)")
    ap.add_argument("--tracemalloc", type=int, default=0, help="with --probe: trace allocations, N frames (slow)")
    ap.add_argument("--no-turn-history", action="store_true", help="with --probe: the server keeps no turns")
    ap.add_argument("--probe-file", default="/tmp/serve_rss_probe.jsonl")
    ap.add_argument("--out", default="serve_rss")
    ap.add_argument("--variant", default="", help="keep this run under `variants.NAME` of the results file "
                    "(the main result and the other variants stay)")
    a = ap.parse_args()
    a.sessions = [int(x) for x in a.sessions.split(",")]
    from tests.reliability.shutdown import raise_nofile_limit

    if a.mode != "churn" and raise_nofile_limit() < max(a.sessions) + 256:
        ap.error(f"a wave of {max(a.sessions)} needs that many open files here: raise `ulimit -Hn`")
    out: dict[str, Any] = {}
    for mode in (("churn", "waves") if a.mode == "both" else (a.mode,)):
        out[mode] = run(a, mode)
    for mode, res in out.items():
        how = f"{a.clients} clients at a time" if mode == "churn" else "N sessions open at once, then closed"
        env = f"  server env {' '.join(a.server_env)}" if a.server_env else ""
        print(f"\n{mode}: {how}{env}")
        print(f"{'point':>16s} {'sessions':>9s} {'RSS MB':>8s}")
        for r in res["rows"]:
            print(f"{r['point']:>16s} {r['sessions']:9d} {r['rss_mb']:8.1f}")
        if res["client_errors"]:
            print(f"client errors: {res['client_errors']}")
    from bench._common import RESULTS_DIR, machine_info

    path = RESULTS_DIR / f"{a.out}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    this = {"meta": machine_info(("websockets",)), "results": out}
    if a.variant:  # a setting beside the default run: kept with it, in the same file
        old.setdefault("variants", {})[a.variant] = this
    else:
        old = {**this, "variants": old.get("variants", {})}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old, indent=2) + "\n")
    print(f"wrote {path}" + (f" (variants.{a.variant})" if a.variant else ""))


if __name__ == "__main__":
    main()
