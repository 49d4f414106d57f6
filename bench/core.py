"""Time-core benchmark: ring throughput and query latency, online and offline cross-modal error.

    .venv/bin/python bench/core.py            # -> bench/results/core.json
    .venv/bin/python bench/core.py --quick    # fewer seeds / iterations (smoke run)

Measures, in one run on one core:
1. audio-chunk appends/s into a 16 kHz `TimeIndexedRing` (20 ms chunks of 320 float32 samples,
   timestamps from a drifting clock so anchors are really written), target >= 200k/s; the
   baseline is a deque of (t, chunk) pairs, the usual Python approach. Throughput is CPU time
   of this thread (best of 3), so other load on a shared machine does not distort it;
2. window-query latency (1 s and 20 ms windows at random places in the last 50 s), target
   <= 20 µs, wall clock per call (P99 includes preemption on a loaded machine); baseline: a list of chunks, bisect and np.concatenate;
3. online cross-modal error vs ground truth after a 10 s warm-up for the synthetic camera +
   microphone + IMU scenario (drift, heavy-tailed jitter, spikes, stalls, reordering, a mic
   clock reset), target P99 <= 2 ms;
4. the same for offline `tristream align` (the real two-pass file path), target P99 <= 0.5 ms;
5. naive arrival-time stamping (and arrival minus the known latency) as the baseline;
6. robustness rows: the same recordings with 0.5 % (online) / 2 % (offline) of packets stamped
   late, i.e. arriving 1-9 ms earlier than physically possible;
7. the scenario family (`tristream.core.family`): for each fault (drift, wrap, loss, network,
   reset; `--family-seeds` seeds each) and all of them together (`--all-seeds` seeds), five-minute
   recordings fitted offline (`fit_source`) and online (clocks + rings + sync, as the session
   runs them), by this tree and by the previous fit (the time core of `--baseline-commit`,
   taken from git and run in a subprocess on the same recordings): cross-modal error P99 after
   10 s, events more than 5 ms off, the online clock's uncertainty coverage, the counters
   against the truth, and CPU per packet;
8. `tristream align` throughput (events/s, thread CPU time, best of 2) on a one-hour recording
   of the whole family;
9. the online CPU per packet split into clock, ring and synchroniser, alone and in context.

The JSON records lscpu (model, flags), the load average at the start and end of each section and
every 5 s over the run, and the machine's busy and steal fractions from /proc/stat per section:
the two cores are shared, so these say how loaded the machine was while the figures were taken.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import cpu_info, write_results  # noqa: E402
from tristream.core.family import FAULTS, generate_family  # noqa: E402
from tristream.core.offline import align_file, fit_source  # noqa: E402
from tristream.core.ring import ObjectRing, TimeIndexedRing  # noqa: E402
from tristream.core.scenario import cross_modal_error, naive_refs, run_online, set_report  # noqa: E402
from tristream.core.synth import generate, stamp_late, to_events, tri_modal_specs  # noqa: E402
from tristream.core.units import parse_unit  # noqa: E402

CHUNK = 320
RATE = 16000
T0 = 10**12


def _chunk_times(n: int) -> list[int]:
    rate = 1.0 + 80e-6  # a drifting source clock mapped to reference time
    return [T0 + round(k * 20_000_000 / rate) for k in range(n)]


def bench_append(n: int) -> dict[str, Any]:
    times = _chunk_times(n)
    chunk = np.random.default_rng(0).standard_normal(CHUNK).astype(np.float32)
    best = 0.0
    for _ in range(3):
        ring = TimeIndexedRing(RATE, RATE * 60)
        t0 = time.thread_time()
        for t in times:
            ring.append(t, chunk)
        best = max(best, n / (time.thread_time() - t0))
    counts = ring.counts.snapshot()
    base_best = 0.0
    for _ in range(3):
        dq: collections.deque[tuple[int, np.ndarray]] = collections.deque(maxlen=60 * 50)
        t0 = time.thread_time()
        for t in times:
            dq.append((t, chunk.copy()))
        base_best = max(base_best, n / (time.thread_time() - t0))
    return {"chunks": n, "appends_per_s": round(best), "baseline_deque_appends_per_s": round(base_best),
            "ring_counters": counts, "target_per_s": 200_000}


def _timeit_ns(fn: Any, args: list[tuple[int, int]]) -> np.ndarray:
    out = np.empty(len(args), dtype=np.int64)
    clock = time.perf_counter_ns
    for k, (a, b) in enumerate(args):
        s = clock()
        fn(a, b)
        out[k] = clock() - s
    return out


def _lat(ns: np.ndarray) -> dict[str, float]:
    p50, p99 = np.percentile(ns, [50, 99])
    return {"p50_us": round(p50 / 1e3, 3), "p99_us": round(p99 / 1e3, 3), "mean_us": round(float(ns.mean()) / 1e3, 3)}


def bench_window(queries: int) -> dict[str, Any]:
    n = 60 * 50
    times = _chunk_times(n)
    chunk = np.ones(CHUNK, np.float32)
    ring = TimeIndexedRing(RATE, RATE * 60)
    dq: collections.deque[tuple[int, np.ndarray]] = collections.deque(maxlen=n)
    for t in times:
        ring.append(t, chunk)
        dq.append((t, chunk.copy()))
    dts = [t for t, _ in dq]
    chunks = [c for _, c in dq]

    def list_window(t0: int, t1: int) -> np.ndarray:
        # The usual Python approach: a list of (t, chunk), bisect, then concatenate (copies).
        i = max(0, bisect.bisect_right(dts, t0) - 1)
        j = bisect.bisect_left(dts, t1)
        return np.concatenate(chunks[i:j])

    rng = np.random.default_rng(1)
    end = times[-1]
    out: dict[str, Any] = {"target_us": 20.0}
    for label, length in (("1s", 1_000_000_000), ("20ms", 20_000_000)):
        starts = rng.integers(end - 50 * 10**9, end - length, queries)
        args = [(int(s), int(s) + length) for s in starts]
        ring.window(*args[0])
        lat = _timeit_ns(ring.window, args)
        w = ring.window(*args[0])
        assert np.shares_memory(w.data, ring._buf) and abs(len(w) - length * RATE / 1e9) <= 2
        base = _timeit_ns(list_window, args[: max(200, queries // 20)])
        out[label] = {"ring": _lat(lat), "baseline_list_concat": _lat(base)}
    frames: ObjectRing[int] = ObjectRing(300)
    for k in range(300):
        frames.append(T0 + k * 33_333_333, k)
    qs = [(int(t), 0) for t in rng.integers(T0, T0 + 300 * 33_333_333, queries)]
    out["frames_latest_at_or_before"] = _lat(_timeit_ns(lambda t, _: frames.latest_at_or_before(t), qs))
    return out


def bench_alignment(seeds: list[int], seconds: float, warmup: float) -> dict[str, Any]:
    pooled: dict[str, list[dict[str, Any]]] = {k: [] for k in ("online", "offline", "naive_arrival",
                                                               "naive_arrival_minus_latency")}
    per_seed = []
    clock_us = []
    align_eps = []
    drift_err = []
    for seed in seeds:
        streams = generate(tri_modal_specs(), seconds, seed)
        online = run_online(streams, sync=True)
        clock_us.append(online.seconds * 1e6 / sum(len(s) for s in streams.values()))
        for sid, s in streams.items():
            drift_err.append(abs(online.clocks[sid].drift_ppm - s.spec.drift_ppm))
        with tempfile.TemporaryDirectory() as tmp:
            inp, outp = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
            events = to_events(streams)
            inp.write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
            t0 = time.thread_time()
            align_file(inp, outp, latency_ns={k: s.spec.latency_ns for k, s in streams.items()})
            align_eps.append(len(events) / (time.thread_time() - t0))
            idx = {(sid, int(s.ts[i]), int(s.arrival_ns[i])): i for sid, s in streams.items() for i in range(len(s))}
            off = {sid: np.zeros(len(s), np.int64) for sid, s in streams.items()}
            for line in outp.read_text(encoding="utf-8").splitlines():
                o = json.loads(line)
                off[o["source"]][idx[(o["source"], o["ts"], o["arrival_ns"])]] = o["ref_ns"]
        errs = {
            "online": cross_modal_error(streams, online.refs, warmup_s=warmup),
            "offline": cross_modal_error(streams, off, warmup_s=warmup),
            "naive_arrival": cross_modal_error(streams, naive_refs(streams), warmup_s=warmup),
            "naive_arrival_minus_latency": cross_modal_error(streams, naive_refs(streams, subtract_latency=True),
                                                             warmup_s=warmup),
        }
        # Robustness: the same recording with some packets stamped late (arriving impossibly early).
        for frac, key in ((0.005, "online_stamped_late_0.5pct"), (0.02, "offline_stamped_late_2pct")):
            bad_streams = generate(tri_modal_specs(), seconds, seed)
            stamp_late(bad_streams, frac, seed + 1000)
            if key.startswith("online"):
                refs = run_online(bad_streams, sync=False).refs
            else:
                refs = {sid: fit_source(sid, s.src_ns, s.src_ns + s.dur_ns, s.arrival_ns,
                                        latency_ns=s.spec.latency_ns).ref_ns for sid, s in bad_streams.items()}
            errs[key] = cross_modal_error(bad_streams, refs, warmup_s=warmup)
        for k, v in errs.items():
            pooled.setdefault(k, []).append(v["all"])
        per_seed.append({"seed": seed, **{k: v["all"] for k, v in errs.items()},
                         "online_pairs": errs["online"]["pairs"], "sync": set_report(streams, online.sets),
                         "counters": online.counters})
    summary = {}
    for k, rows in pooled.items():
        summary[k] = {"p50_ms_median": float(np.median([r["p50"] for r in rows])),
                      "p99_ms_worst": max(r["p99"] for r in rows),
                      "p99_ms_median": float(np.median([r["p99"] for r in rows])),
                      "max_ms_worst": max(r["max"] for r in rows)}
    return {"seconds": seconds, "warmup_s": warmup, "seeds": seeds, "summary": summary, "per_seed": per_seed,
            "targets_p99_ms": {"online": 2.0, "offline": 0.5},
            "online_clock_us_per_packet": round(float(np.mean(clock_us)), 2),
            "online_drift_abs_error_ppm_max": round(max(drift_err), 3),
            "align_events_per_s": round(float(np.mean(align_eps)))}


_BASELINE = r"""
import json, sys, time
import numpy as np
from tristream.core.offline import fit_source
from tristream.core.scenario import run_online
from tristream.core.synth import SourceSpec, SyntheticStream
out = {}
for path in sys.argv[1:]:
    z = np.load(path, allow_pickle=False)
    streams = {}
    for sid in [str(x) for x in z["sources"]]:
        spec = SourceSpec(sid, str(z[sid + ".modality"]), str(z[sid + ".unit"]), 1, int(z[sid + ".samples"]),
                          latency_ns=int(z[sid + ".latency"]))
        n = z[sid + ".src"].size
        streams[sid] = SyntheticStream(spec, z[sid + ".src"], z[sid + ".src"], z[sid + ".dur"], z[sid + ".arr"],
                                       z[sid + ".true"], np.zeros(n, np.int64))
    off = {sid: fit_source(sid, s.src_ns, s.src_ns + s.dur_ns, s.arrival_ns, latency_ns=s.spec.latency_ns).ref_ns
           for sid, s in streams.items()}
    on = run_online(streams, sync=True)
    n = sum(len(s) for s in streams.values())
    np.savez(path + ".out.npz", **{"off." + k: v for k, v in off.items()}, **{"on." + k: v for k, v in on.refs.items()})
    out[path] = on.seconds * 1e6 / n
print(json.dumps(out))
"""


_CPU_BASELINE = r"""
import json, sys
import numpy as np
from tristream.core.scenario import run_online
from tristream.core.synth import SourceSpec, SyntheticStream
reps = int(sys.argv[1])
out = {}
for path in sys.argv[2:]:
    z = np.load(path, allow_pickle=False)
    streams = {}
    for sid in [str(x) for x in z["sources"]]:
        spec = SourceSpec(sid, str(z[sid + ".modality"]), str(z[sid + ".unit"]), 1, int(z[sid + ".samples"]),
                          latency_ns=int(z[sid + ".latency"]))
        n = z[sid + ".src"].size
        streams[sid] = SyntheticStream(spec, z[sid + ".src"], z[sid + ".src"], z[sid + ".dur"], z[sid + ".arr"],
                                       z[sid + ".true"], np.zeros(n, np.int64))
    n = sum(len(s) for s in streams.values())
    out[path] = min(run_online(streams, sync=True).seconds for _ in range(reps)) * 1e6 / n
print(json.dumps(out))
"""


def _tree(commit: str, dest: Path) -> Path | None:
    """`tristream/core` of `commit` extracted under `dest` (a PYTHONPATH root); None when git cannot give it."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        arch = subprocess.run(["git", "archive", commit, "tristream/__init__.py", "tristream/core"], cwd=ROOT,
                              capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"no tree for {commit}:", getattr(exc, "stderr", exc))
        return None
    return dest


def _cpu_baseline(commit: str, paths: list[Path], tmp: Path, reps: int) -> dict[str, float] | None:
    """Online CPU per packet (best of `reps`) of the time core at `commit` on the saved recordings."""
    tree = _tree(commit, tmp / f"cpu-{commit}")
    if tree is None:
        return None
    try:
        res = subprocess.run([sys.executable, "-c", _CPU_BASELINE, str(reps), *map(str, paths)], cwd=tmp,
                             capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(tree)})
    except (OSError, subprocess.CalledProcessError) as exc:
        print("cpu baseline run failed:", getattr(exc, "stderr", exc))
        return None
    return {k: float(v) for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def _save(path: Path, streams: dict[str, Any]) -> None:
    arrs: dict[str, Any] = {"sources": np.array(list(streams))}
    for sid, s in streams.items():
        arrs.update({sid + ".src": s.src_ns, sid + ".dur": s.dur_ns, sid + ".arr": s.arrival_ns,
                     sid + ".true": s.true_ref_ns, sid + ".modality": np.array(s.spec.modality),
                     sid + ".unit": np.array(s.spec.unit), sid + ".samples": np.array(s.spec.samples),
                     sid + ".latency": np.array(s.spec.latency_ns)})
    np.savez(path, **arrs)


def _baseline(commit: str, paths: list[Path], tmp: Path) -> dict[str, float] | None:
    """Run the time core of `commit` on the saved recordings; None when git cannot give it."""
    tree = tmp / "baseline"
    tree.mkdir()
    try:
        arch = subprocess.run(["git", "archive", commit, "tristream/__init__.py", "tristream/core"], cwd=ROOT,
                              capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=arch, check=True)
        res = subprocess.run([sys.executable, "-c", _BASELINE, *map(str, paths)], cwd=tmp, capture_output=True,
                             text=True, check=True, env={**os.environ, "PYTHONPATH": str(tree)})
    except (OSError, subprocess.CalledProcessError) as exc:
        print("baseline run failed:", getattr(exc, "stderr", exc))
        return None
    return {k: float(v) for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def _score(streams: dict[str, Any], refs: dict[str, np.ndarray], warmup: float) -> dict[str, Any]:
    err = cross_modal_error(streams, refs, warmup_s=warmup)
    off5 = {sid: int(np.sum(np.abs(refs[sid] - s.true_ref_ns) > 5e6)) for sid, s in streams.items()}
    return {"p99_ms": err["all"]["p99"], "max_ms": err["all"]["max"], "events_over_5ms": sum(off5.values()),
            "events_over_5ms_per_source": off5, "absolute_p99_ms": {k: v["p99"] for k, v in err["absolute"].items()}}


def bench_family(seeds_per_fault: int, all_seeds: int, seconds: float, warmup: float, baseline: str,
                 cpu_baseline: str | None = None, cpu_reps: int = 3) -> dict[str, Any]:
    cases = [(f, seed) for f in FAULTS for seed in range(1, seeds_per_fault + 1)]
    cases += [("all", seed) for seed in range(1, all_seeds + 1)]
    rows = []
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        recs = []
        for k, (fault, seed) in enumerate(cases):
            streams = generate_family(fault, seed, seconds)
            path = tmp / f"rec{k}.npz"
            _save(path, streams)
            recs.append((fault, seed, streams, path))
        base_cpu = _baseline(baseline, [r[3] for r in recs], tmp)
        start_cpu = _cpu_baseline(cpu_baseline, [r[3] for r in recs], tmp, cpu_reps) if cpu_baseline else None
        for fault, seed, streams, path in recs:
            n = sum(len(s) for s in streams.values())
            t0 = time.thread_time()
            fits = {sid: fit_source(sid, s.src_ns, s.src_ns + s.dur_ns, s.arrival_ns, latency_ns=s.spec.latency_ns,
                                    wrap_ns=parse_unit(s.spec.unit).wrap_ns) for sid, s in streams.items()}
            fit_s = time.thread_time() - t0
            runs = [run_online(streams, sync=True) for _ in range(cpu_reps)]  # CPU: the best of `cpu_reps`
            online = min(runs, key=lambda r: r.seconds)
            cpu_runs = sorted(round(r.seconds * 1e6 / n, 2) for r in runs)
            unc = run_online(streams, sync=False, uncertainty=True)
            cov, u50 = {}, {}
            for sid, s in streams.items():
                keep = s.true_ref_ns >= s.true_ref_ns.min() + warmup * 1e9
                e = np.abs(unc.refs[sid] - s.true_ref_ns)[keep]
                cov[sid] = round(float(np.mean(e <= unc.uncertainty[sid][keep])), 5)
                u50[sid] = round(float(np.median(unc.uncertainty[sid][keep])) / 1e6, 4)
            truth = {sid: s.meta["truth"] for sid, s in streams.items()}
            counted_off = {sid: {k: f.summary[k] for k in ("wraps", "duplicates", "gaps", "lost_packets", "resets")}
                           for sid, f in fits.items()}
            counted_on = {sid: {k: online.counters[f"clock:{sid}"].get(k, 0)
                                for k in ("wrap", "duplicate", "gap", "lost", "reset", "outlier")} for sid in streams}
            row: dict[str, Any] = {
                "fault": fault, "seed": seed, "packets": n,
                "offline": _score(streams, {sid: f.ref_ns for sid, f in fits.items()}, warmup),
                "online": _score(streams, online.refs, warmup),
                "online_uncertainty_coverage": cov, "online_uncertainty_p50_ms": u50,
                "online_cpu_us_per_packet": round(online.seconds * 1e6 / n, 2),
                "online_cpu_us_per_packet_runs": cpu_runs,
                "online_gc_us_per_packet": round(online.gc_seconds * 1e6 / n, 2),
                "offline_fit_events_per_s": round(n / fit_s),
                "truth": truth, "counted_offline": counted_off, "counted_online": counted_on,
            }
            if base_cpu is not None:
                z = np.load(str(path) + ".out.npz")
                row["baseline_offline"] = _score(streams, {sid: z["off." + sid] for sid in streams}, warmup)
                row["baseline_online"] = _score(streams, {sid: z["on." + sid] for sid in streams}, warmup)
                row["baseline_online_cpu_us_per_packet"] = round(base_cpu[str(path)], 2)
            if start_cpu is not None:
                row["start_online_cpu_us_per_packet"] = round(start_cpu[str(path)], 2)
            rows.append(row)
    summary: dict[str, Any] = {}
    for key in ("offline", "online", "baseline_offline", "baseline_online"):
        got = [r for r in rows if key in r]
        if not got:
            continue
        summary[key] = {
            "p99_ms_worst": max(r[key]["p99_ms"] for r in got),
            "p99_ms_median": float(np.median([r[key]["p99_ms"] for r in got])),
            "events_over_5ms_worst": max(r[key]["events_over_5ms"] for r in got),
            "per_fault_p99_ms_worst": {f: max(r[key]["p99_ms"] for r in got if r["fault"] == f)
                                       for f in (*FAULTS, "all")},
        }
    summary["online_coverage_worst"] = min(min(r["online_uncertainty_coverage"].values()) for r in rows)
    summary["online_coverage_pooled"] = round(float(np.mean([np.mean(list(r["online_uncertainty_coverage"].values()))
                                                             for r in rows])), 5)
    summary["online_cpu_us_per_packet_best"] = min(r["online_cpu_us_per_packet"] for r in rows)
    summary["online_cpu_us_per_packet_median"] = float(np.median([r["online_cpu_us_per_packet"] for r in rows]))
    if rows and "baseline_online_cpu_us_per_packet" in rows[0]:
        summary["baseline_online_cpu_us_per_packet_median"] = float(
            np.median([r["baseline_online_cpu_us_per_packet"] for r in rows]))
    if rows and "start_online_cpu_us_per_packet" in rows[0]:
        summary["start_online_cpu_us_per_packet_best"] = min(r["start_online_cpu_us_per_packet"] for r in rows)
        summary["start_online_cpu_us_per_packet_median"] = float(
            np.median([r["start_online_cpu_us_per_packet"] for r in rows]))
    summary["online_cpu_us_per_packet_max"] = max(r["online_cpu_us_per_packet"] for r in rows)
    summary["online_gc_us_per_packet_median"] = float(np.median([r["online_gc_us_per_packet"] for r in rows]))
    summary["counts_match_truth_offline"] = all(
        r["counted_offline"][sid] == {"wraps": t["wraps"], "duplicates": t["duplicates"], "gaps": t["gaps"],
                                      "lost_packets": t["lost"], "resets": t["resets"]}
        for r in rows for sid, t in r["truth"].items())
    summary["counts_match_truth_online"] = all(
        {k: r["counted_online"][sid][k] for k in ("wrap", "duplicate", "gap", "lost", "reset")}
        == {"wrap": t["wraps"], "duplicate": t["duplicates"], "gap": t["gaps"], "lost": t["lost"], "reset": t["resets"]}
        for r in rows for sid, t in r["truth"].items())
    return {"seconds": seconds, "warmup_s": warmup, "baseline_commit": baseline, "cpu_baseline_commit": cpu_baseline,
            "cpu_reps": cpu_reps, "summary": summary, "rows": rows,
            "targets": {"offline_p99_ms": 0.3, "offline_events_over_5ms": 5, "online_p99_ms": 1.0,
                        "online_coverage": 0.99, "online_cpu_us_per_packet": 10.0}}


def bench_online_split(seed: int = 2, seconds: float = 300.0, repeats: int = 3) -> dict[str, Any]:
    """CPU per packet of the online parts on one all-faults recording (thread CPU, best of
    `repeats`): each part alone (the clocks; the rings and the synchroniser fed the clocks'
    reference times), and in context: the replay loop with all three, and without each one (the
    part's reference times then come precomputed), whose difference is that part's share of the
    whole (the parts evict each other's working set, so together they cost more than alone)."""
    from tristream.core.clock import SourceClock
    from tristream.core.sync import ApproximateTimeSync
    from tristream.core.synth import arrival_order

    streams = generate_family("all", seed, seconds)
    refs = run_online(streams, sync=False).refs
    order = arrival_order(streams)
    n = len(order)

    def loop(use_clock: bool, use_ring: bool, use_sync: bool) -> float:
        cl = {sid: SourceClock(sid, latency_ns=s.spec.latency_ns, wrap_ns=parse_unit(s.spec.unit).wrap_ns)
              for sid, s in streams.items()}
        rg: dict[str, Any] = {}
        blocks: dict[str, Any] = {}
        for sid, s in streams.items():
            if s.spec.modality == "video":
                rg[sid] = ObjectRing(300, lateness_ns=100_000_000, name=sid)
                continue
            rate = s.spec.samples * 1e9 / float(s.dur_ns[0])
            ch = 1 if s.spec.modality == "audio" else 6
            rg[sid] = TimeIndexedRing(rate, int(rate * 10), channels=ch, lateness_ns=100_000_000, name=sid)
            blk = np.zeros((s.spec.samples, ch), np.float32)
            blocks[sid] = blk[:, 0] if ch == 1 else blk
        sy = ApproximateTimeSync(list(streams), max_interval_ns=40_000_000, lateness_ns=100_000_000,
                                 idle_timeout_ns=500_000_000)
        plan = []
        for sid, i in order:
            s = streams[sid]
            start = int(s.src_ns[i])
            plan.append((sid, i, cl[sid].observe_span, rg[sid].append, blocks.get(sid, i), start,
                         start + int(s.dur_ns[i]), int(s.arrival_ns[i]), int(refs[sid][i])))
        push = sy.push
        sets: list[Any] = []
        t0 = time.thread_time()
        if use_clock and use_ring and use_sync:
            for sid, i, observe, append, payload, start, end, arr, _ in plan:
                ref = observe(start, end, arr)
                append(ref, payload)
                sets += push(sid, ref, (sid, i), arr)
        else:
            for sid, i, observe, append, payload, start, end, arr, ref in plan:
                if use_clock:
                    ref = observe(start, end, arr)
                if use_ring:
                    append(ref, payload)
                if use_sync:
                    sets += push(sid, ref, (sid, i), arr)
        if use_sync:
            sets += sy.flush()
        return (time.thread_time() - t0) * 1e6 / n

    def best(*parts: bool) -> float:
        return round(min(loop(*parts) for _ in range(repeats)), 2)

    alone = {"clock_us": best(True, False, False), "ring_us": best(False, True, False),
             "sync_us": best(False, False, True)}
    together = best(True, True, True)
    without = {"clock": best(False, True, True), "ring": best(True, False, True), "sync": best(True, True, False)}
    return {"seed": seed, "packets": n, "repeats": repeats, **alone,
            "in_context": {"all_us": together, **{f"without_{k}_us": v for k, v in without.items()},
                           **{f"{k}_share_us": round(together - v, 2) for k, v in without.items()}}}


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


_ALIGN_TIMED = ("import json, os, sys, time; from pathlib import Path; from tristream.core.offline import align_file\n"
                "out = []\n"
                "for w in map(int, sys.argv[3].split(',')):\n"
                "    for _ in range(int(sys.argv[4])):\n"
                "        t, c = time.perf_counter(), os.times()\n"
                "        align_file(Path(sys.argv[1]), Path(sys.argv[2]), workers=w)\n"
                "        d = os.times()\n"
                "        out.append((w, time.perf_counter() - t, d.user + d.system + d.children_user + d.children_system"
                " - c.user - c.system - c.children_user - c.children_system))\n"
                "print(json.dumps(out))\n")


def _align_interleaved(trees: dict[str, Path], inp: Path, outp: Path, n: int, rounds: int) -> dict[str, Any]:
    """`align_file` of each tree (a PYTHONPATH root) in a fresh process, the trees taking turns
    (the order alternating each round), two calls per worker count a process: events/s of every
    call, and the best per tree and worker count. Runs side by side on a shared machine see the
    same load."""
    got: dict[str, dict[str, list[int]]] = {name: {} for name in trees}
    names = list(trees)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            res = subprocess.run([sys.executable, "-c", _ALIGN_TIMED, str(inp), str(outp), "1,2", "2"],
                                 capture_output=True, text=True, check=True, cwd=inp.parent,
                                 env={**os.environ, "PYTHONPATH": str(trees[name])})
            for w, wall, _cpu in json.loads(res.stdout.strip().splitlines()[-1]):
                got[name].setdefault(f"workers_{w}", []).append(round(n / wall))
    return {"rounds": rounds, "events_per_s": got,
            "best": {name: {k: max(v) for k, v in per.items()} for name, per in got.items()}}


def bench_align_throughput(seconds: float, repeats: int = 3, baseline: str | None = None,
                           previous: str | None = None) -> dict[str, Any]:
    """`tristream align` on one recording of the whole family, end to end (file read -> output
    written): wall time and CPU (this process and its forked workers) of `align_file` per worker
    count, best and all of `repeats`; the CLI as a fresh process (interpreter start and imports
    included); `align_file` of the time core at `baseline` on the same file; and this tree against
    the time core at `previous`, interleaved in fresh processes (`_align_interleaved`)."""
    from tristream.core.forkjoin import free_cores, usable_cores

    streams = generate_family("all", 7, seconds)
    events = to_events(streams)
    for e in events:  # the family's own units (wrapping RTP/PTS) travel in the file
        if e["modality"] == "audio" and not e["unit"].startswith("samples@"):
            e["sample_rate"] = parse_unit(e["unit"]).ticks_per_s
    n = len(events)
    out: dict[str, Any] = {"seconds": seconds, "events": n, "repeats": repeats, "target_events_per_s": 1_000_000,
                           "usable_cores": usable_cores(), "free_cores_at_start": free_cores()}
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        inp, outp = tmp / "in.jsonl", tmp / "out.jsonl"
        inp.write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
        out["bytes"] = inp.stat().st_size
        runs: dict[str, list[dict[str, float]]] = {}
        for workers in sorted({min(usable_cores(), 4), 1}, reverse=True):
            got = []
            for _ in range(repeats):
                w0, c0 = time.perf_counter(), _cpu_s()
                summary = align_file(inp, outp, workers=workers)
                wall, cpu = time.perf_counter() - w0, _cpu_s() - c0
                got.append({"events_per_s": round(n / wall), "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)})
            runs[f"workers_{workers}"] = got
        out["align_file"] = runs
        best = max(r["events_per_s"] for rs in runs.values() for r in rs)
        out["events_per_s_best"] = best
        key = f"workers_{min(usable_cores(), 4)}"
        out["events_per_s_median_default"] = float(np.median([r["events_per_s"] for r in runs[key]]))
        out["counts"] = {k: {kk: v[kk] for kk in ("epochs", "wraps", "duplicates", "gaps", "resets")}
                         for k, v in summary["sources"].items()}
        cli = []
        for _ in range(repeats):
            w0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "tristream.cli", "align", str(inp), "-o", str(outp), "--summary",
                            str(tmp / "s.json")], check=True, capture_output=True, cwd=ROOT)
            cli.append(round(n / (time.perf_counter() - w0)))
        out["cli_events_per_s"] = cli
        w0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import tristream.cli"], check=True, capture_output=True, cwd=ROOT)
        out["cli_import_s"] = round(time.perf_counter() - w0, 3)
        if baseline:
            tree = _tree(baseline, tmp / f"align-{baseline}")
            if tree is not None:
                code = ("import sys, time; from pathlib import Path; from tristream.core.offline import align_file; "
                        "t = time.perf_counter(); align_file(Path(sys.argv[1]), Path(sys.argv[2])); "
                        "print(time.perf_counter() - t)")
                res = subprocess.run([sys.executable, "-c", code, str(inp), str(outp)], capture_output=True,
                                     text=True, check=True, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tmp)
                out["baseline_commit"] = baseline
                out["baseline_events_per_s"] = round(n / float(res.stdout.strip().splitlines()[-1]))
        if previous:
            tree = _tree(previous, tmp / f"align-{previous}")
            if tree is not None:
                out["interleaved"] = {"previous_commit": previous,
                                      **_align_interleaved({"ours": ROOT, previous: tree}, inp, outp, n, repeats)}
    return out


def _lscpu() -> dict[str, str]:
    try:
        txt = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    out = {}
    for line in txt.splitlines():
        k, _, v = line.partition(":")
        if k.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "Flags", "CPU max MHz"):
            out[k.strip()] = v.strip()
    return out


def _proc_stat() -> list[int]:
    """The machine's CPU time counters (USER_HZ ticks): user nice system idle iowait irq softirq steal."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            return [int(x) for x in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def _stat_since(before: list[int], load_before: list[float]) -> dict[str, Any]:
    """What the whole machine did since `before`: busy and steal fractions of its CPU time, and
    the load average then and now."""
    now = _proc_stat()
    out: dict[str, Any] = {"load_average_before": load_before,
                           "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    if before and now:
        d = [b - a for a, b in zip(before, now, strict=True)]
        total = sum(d)
        if total > 0:
            out["busy_fraction"] = round((total - d[3] - d[4]) / total, 4)
            out["steal_fraction"] = round(d[7] / total, 5)
            out["steal_s"] = round(d[7] / os.sysconf("SC_CLK_TCK"), 2)
            out["cpu_s_all_processes"] = round((total - d[3] - d[4]) / os.sysconf("SC_CLK_TCK"), 2)
    return out


class _LoadSampler:
    """The 1-minute load average every `every_s` seconds while a run goes on (a sleeping thread)."""

    def __init__(self, every_s: float = 5.0) -> None:
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.samples.append(round(os.getloadavg()[0], 2))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        xs = self.samples or [round(os.getloadavg()[0], 2)]
        return {"samples_1min": xs, "min": min(xs), "max": max(xs), "mean": round(sum(xs) / len(xs), 2)}


def _print_family(fam: dict[str, Any], thr: dict[str, Any]) -> None:
    sm = fam["summary"]
    print(f"scenario family, {fam['seconds']:.0f} s recordings, error after {fam['warmup_s']:.0f} s "
          f"(P99 ms worst per fault; events > 5 ms worst):")
    print(f"  {'fit':18s} " + " ".join(f"{f:>8s}" for f in (*FAULTS, "all")) + "   >5ms  target")
    for key, tgt in (("offline", "P99 <= 0.3, <= 5"), ("baseline_offline", "previous fit"),
                     ("online", "P99 <= 1"), ("baseline_online", "previous clock")):
        if key in sm:
            v = sm[key]
            print(f"  {key:18s} " + " ".join(f"{v['per_fault_p99_ms_worst'][f]:8.3f}" for f in (*FAULTS, "all"))
                  + f" {v['events_over_5ms_worst']:6d}  {tgt}")
    print(f"  online uncertainty coverage: worst source {sm['online_coverage_worst']}, mean {sm['online_coverage_pooled']}"
          f" (target >= 0.99); counts match truth: offline {sm['counts_match_truth_offline']}, online "
          f"{sm['counts_match_truth_online']}")
    print(f"  online clock+ring+sync CPU (thread CPU, best of {fam['cpu_reps']} per recording): best "
          f"{sm['online_cpu_us_per_packet_best']} µs/packet, median {sm['online_cpu_us_per_packet_median']}, worst "
          f"{sm['online_cpu_us_per_packet_max']}, of which the cyclic GC median {sm['online_gc_us_per_packet_median']}"
          f" (time core at {fam['cpu_baseline_commit']}: best "
          f"{sm.get('start_online_cpu_us_per_packet_best')}, median {sm.get('start_online_cpu_us_per_packet_median')};"
          f" previous clock median {sm.get('baseline_online_cpu_us_per_packet_median')}; target <= 10)")
    print(f"tristream align, {thr['seconds']:.0f} s recording ({thr['events']:,d} events, {thr['bytes'] / 1e6:.0f} MB),"
          f" file read -> output written, {thr['usable_cores']} cores (target >= 1M events/s):")
    for k, rs in thr["align_file"].items():
        print(f"  align_file {k}: " + ", ".join(f"{r['events_per_s']:,d}/s ({r['wall_s']} s wall, {r['cpu_s']} s CPU)"
                                                for r in rs))
    print(f"  the CLI as a new process: {', '.join(f'{v:,d}/s' for v in thr['cli_events_per_s'])} (its imports alone "
          f"{thr['cli_import_s']} s); align_file at {thr.get('baseline_commit')}: "
          f"{thr.get('baseline_events_per_s', 0):,d}/s")
    il = thr.get("interleaved")
    if il:
        print(f"  taking turns with the time core at {il['previous_commit']} (fresh processes, {il['rounds']} rounds, "
              "best events/s): " + "; ".join(f"{name} " + ", ".join(f"{k} {v:,d}" for k, v in sorted(b.items()))
                                             for name, b in il["best"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--family-seeds", type=int, default=3)
    ap.add_argument("--all-seeds", type=int, default=5)
    ap.add_argument("--baseline-commit", default="b9c10f6", help="time core to compare with (git commit)")
    ap.add_argument("--cpu-baseline-commit", default="c877a37",
                    help="time core whose online CPU and align throughput are measured beside ours (git commit)")
    ap.add_argument("--align-previous-commit", default="de38621",
                    help="time core whose align_file takes turns with ours in fresh processes (git commit)")
    ap.add_argument("--only-family", action="store_true", help="skip the ring and old-scenario sections")
    ap.add_argument("--cpu-reps", type=int, default=5,
                    help="online runs per recording whose least CPU is taken (every run is recorded)")
    args = ap.parse_args()
    n_app = 50_000 if args.quick else 300_000
    seeds = [1, 2] if args.quick else [1, 2, 3, 4, 5]
    res: dict[str, Any] = {"lscpu": _lscpu(), "cpu": cpu_info(),
                           "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    sampler = _LoadSampler()
    stat0, load0 = _proc_stat(), res["load_average_at_start"]
    machine: dict[str, Any] = {}
    res["machine_during"] = machine  # per section: busy and steal fractions of the machine, load
    res["family"] = bench_family(1 if args.quick else args.family_seeds, 1 if args.quick else args.all_seeds,
                                 60.0 if args.quick else 300.0, 10.0, args.baseline_commit, args.cpu_baseline_commit,
                                 1 if args.quick else args.cpu_reps)
    machine["family"] = _stat_since(stat0, load0)
    stat1, load1 = _proc_stat(), [round(x, 2) for x in os.getloadavg()]
    res["align_throughput"] = bench_align_throughput(300.0 if args.quick else 3600.0, 2 if args.quick else 3,
                                                     args.cpu_baseline_commit, args.align_previous_commit)
    machine["align_throughput"] = _stat_since(stat1, load1)
    stat2, load2 = _proc_stat(), [round(x, 2) for x in os.getloadavg()]
    res["online_split"] = bench_online_split(seconds=60.0 if args.quick else 300.0)
    machine["online_split"] = _stat_since(stat2, load2)
    _print_family(res["family"], res["align_throughput"])
    sp = res["online_split"]
    ic = sp["in_context"]
    print(f"  parts alone (all faults, seed {sp['seed']}, best of {sp['repeats']}): clock {sp['clock_us']} µs, "
          f"ring {sp['ring_us']} µs, sync {sp['sync_us']} µs per packet; in context (all three {ic['all_us']} µs, "
          f"less the loop without each): clock {ic['clock_share_us']}, ring {ic['ring_share_us']}, sync "
          f"{ic['sync_share_us']} µs")
    for sec, m in machine.items():
        print(f"  machine during {sec}: busy {m.get('busy_fraction')}, steal {m.get('steal_fraction')}, load "
              f"{m['load_average_before']} -> {m['load_average_after']}")
    if args.only_family:
        machine["whole_run"] = _stat_since(stat0, load0)
        res["load_average_samples"] = sampler.stop()
        res["load_average_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
        print(f"load average during the run: {res['load_average_1_5_15']} on {os.cpu_count()} CPUs")
        if not args.no_write:
            print("wrote", write_results("core_family", res))
        return
    res.update({
        "append": bench_append(n_app),
        "window": bench_window(2_000 if args.quick else 20_000),
        "alignment": bench_alignment(seeds, 60.0, 10.0),
    })
    a, w, al = res["append"], res["window"], res["alignment"]
    print(f"{'metric':58s} {'tristream':>14s} {'baseline':>14s} {'target':>10s}")
    print(f"{'16 kHz ring, 20 ms chunk appends/s (one core)':58s} {a['appends_per_s']:>14,d} "
          f"{a['baseline_deque_appends_per_s']:>14,d} {'>= 200k':>10s}")
    for label in ("1s", "20ms"):
        r, b = w[label]["ring"], w[label]["baseline_list_concat"]
        print(f"{'window query ' + label + ' P50 / P99 (µs)':58s} {r['p50_us']:>6.2f} /{r['p99_us']:>6.2f} "
              f"{b['p50_us']:>6.1f} /{b['p99_us']:>6.1f} {'<= 20':>10s}")
    fr = w["frames_latest_at_or_before"]
    print(f"{'frame ring latest_at_or_before P50 / P99 (µs)':58s} {fr['p50_us']:>6.2f} /{fr['p99_us']:>6.2f}")
    s = al["summary"]
    print(f"cross-modal error vs truth, ms, {len(al['seeds'])} seeds x {al['seconds']:.0f} s, after "
          f"{al['warmup_s']:.0f} s warm-up (P50 median / P99 median / P99 worst / max worst):")
    for k, target in (("online", "P99 <= 2"), ("offline", "P99 <= 0.5"), ("naive_arrival", ""),
                      ("naive_arrival_minus_latency", ""), ("online_stamped_late_0.5pct", "robustness"),
                      ("offline_stamped_late_2pct", "robustness")):
        v = s[k]
        print(f"  {k:56s} {v['p50_ms_median']:8.4f} {v['p99_ms_median']:8.4f} {v['p99_ms_worst']:8.4f} "
              f"{v['max_ms_worst']:9.3f}  {target}")
    print(f"online clock+ring+sync CPU cost: {al['online_clock_us_per_packet']} µs/packet; worst online drift error "
          f"{al['online_drift_abs_error_ppm_max']} ppm; tristream align: {al['align_events_per_s']:,d} events/s")
    machine["whole_run"] = _stat_since(stat0, load0)
    res["load_average_samples"] = sampler.stop()
    res["load_average_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average during the run: {res['load_average_1_5_15']} on {os.cpu_count()} CPUs (sampled every 5 s: "
          f"{res['load_average_samples']['min']}-{res['load_average_samples']['max']}); machine busy "
          f"{machine['whole_run'].get('busy_fraction')}, steal {machine['whole_run'].get('steal_fraction')}")
    if not args.no_write:
        print("wrote", write_results("core", res))


if __name__ == "__main__":
    main()
