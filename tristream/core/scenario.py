"""Run the time core over a synthetic recording and score it against ground truth.

Shared by `tristream demo`, `bench/core.py` and the tests: packets are replayed in arrival
order (processing time = arrival time, a virtual clock), each source is mapped by its own
`SourceClock`, fixed-rate streams go into `TimeIndexedRing`s, frames into an `ObjectRing`, and
an `ApproximateTimeSync` forms camera/microphone/IMU sets.
"""

from __future__ import annotations

import gc
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tristream.core.align import AlignedWindow
from tristream.core.clock import SourceClock
from tristream.core.ring import ObjectRing, TimeIndexedRing
from tristream.core.sync import ApproximateTimeSync
from tristream.core.synth import SyntheticStream, arrival_order
from tristream.core.units import parse_unit


@dataclass(slots=True)
class OnlineResult:
    """What an online replay produced."""

    refs: dict[str, np.ndarray]
    clocks: dict[str, SourceClock]
    sets: list[AlignedWindow] = field(default_factory=list)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    fill: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    uncertainty: dict[str, np.ndarray] = field(default_factory=dict)
    gc_seconds: float = 0.0  # of `seconds`, in the cyclic garbage collector


def run_online(
    streams: dict[str, SyntheticStream],
    *,
    sync: bool = True,
    max_interval_ns: int = 40_000_000,
    lateness_ns: int = 100_000_000,
    idle_timeout_ns: int = 500_000_000,
    uncertainty: bool = False,
) -> OnlineResult:
    """Replay `streams` in arrival order through clocks, rings and (optionally) the synchroniser.

    With `uncertainty`, each packet's reported uncertainty is recorded too (outside the timed path's
    usual work, so leave it off when measuring CPU cost).
    """
    clocks = {sid: SourceClock(sid, latency_ns=s.spec.latency_ns, wrap_ns=parse_unit(s.spec.unit).wrap_ns)
              for sid, s in streams.items()}
    unc = {sid: np.zeros(len(s)) for sid, s in streams.items()} if uncertainty else {}
    refs = {sid: np.zeros(len(s), dtype=np.int64) for sid, s in streams.items()}
    rings: dict[str, Any] = {}
    for sid, s in streams.items():
        if s.spec.modality == "video":
            rings[sid] = ObjectRing(300, lateness_ns=lateness_ns, name=sid)
        else:
            rate = s.spec.samples * 1e9 / float(s.dur_ns[0])
            ch = 1 if s.spec.modality == "audio" else 6
            rings[sid] = TimeIndexedRing(rate, int(rate * 10), channels=ch, lateness_ns=lateness_ns, name=sid)
    synchroniser = ApproximateTimeSync(list(streams), max_interval_ns=max_interval_ns, lateness_ns=lateness_ns,
                                       idle_timeout_ns=idle_timeout_ns)
    blocks = {sid: np.zeros((s.spec.samples, 1 if s.spec.modality == "audio" else 6), np.float32)
              for sid, s in streams.items() if s.spec.samples}
    for sid in blocks:
        if streams[sid].spec.modality == "audio":
            blocks[sid] = blocks[sid][:, 0]
    sets: list[AlignedWindow] = []
    # The replay plan is built first, so the timed loop holds only the work a session does per
    # packet: map it with its clock, append it to its ring, push it to the synchroniser.
    plan = []
    for sid, i in arrival_order(streams):
        s = streams[sid]
        start = int(s.src_ns[i])
        plan.append((sid, i, clocks[sid].observe_span, rings[sid].append, blocks.get(sid, i), start,
                     start + int(s.dur_ns[i]), int(s.arrival_ns[i])))
    push = synchroniser.push
    out: list[int] = []
    keep = out.append
    u_out: list[float] = []
    in_gc = [0.0, 0.0]

    def gc_time(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            in_gc[1] = time.thread_time()
        else:
            in_gc[0] += time.thread_time() - in_gc[1]

    gc.callbacks.append(gc_time)
    t0 = time.thread_time()
    if uncertainty:
        for sid, i, observe, append, payload, start, end, arr in plan:
            ref = observe(start, end, arr)
            keep(ref)
            u_out.append(clocks[sid].uncertainty_ns)
            append(ref, payload)
            if sync:
                sets += push(sid, ref, (sid, i), arr)
    elif sync:
        for sid, i, observe, append, payload, start, end, arr in plan:
            ref = observe(start, end, arr)
            keep(ref)
            append(ref, payload)
            sets += push(sid, ref, (sid, i), arr)
    else:
        for _sid, _i, observe, append, payload, start, end, arr in plan:
            ref = observe(start, end, arr)
            keep(ref)
            append(ref, payload)
    if sync:
        sets += synchroniser.flush()
    seconds = time.thread_time() - t0  # CPU time of this thread: robust on a shared machine
    gc.callbacks.remove(gc_time)
    for k, p in enumerate(plan):
        refs[p[0]][p[1]] = out[k]
        if uncertainty:
            unc[p[0]][p[1]] = u_out[k]
    for c in clocks.values():  # end of the recording: holes still open are gaps
        c.close()
    counters: dict[str, dict[str, int]] = {f"clock:{k}": c.counts.snapshot() for k, c in clocks.items()}
    counters.update({f"ring:{k}": r.counts.snapshot() for k, r in rings.items()})
    counters["sync"] = synchroniser.counts.snapshot()
    fill = {k: float(r.high_water) for k, r in rings.items()}
    return OnlineResult(refs, clocks, sets, counters, fill, seconds, unc, in_gc[0])


def naive_refs(streams: dict[str, SyntheticStream], *, subtract_latency: bool = False) -> dict[str, np.ndarray]:
    """Baseline: stamp every packet with its arrival time (optionally minus the known latency)."""
    out = {}
    for sid, s in streams.items():
        ref = s.arrival_ns - s.dur_ns
        out[sid] = ref - s.spec.latency_ns if subtract_latency else ref
    return out


def _stats_ms(err_ns: np.ndarray) -> dict[str, float]:
    a = np.abs(err_ns.astype(np.float64))
    if a.size == 0:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "n": 0}
    p50, p99 = np.percentile(a, [50, 99])
    return {"p50": round(p50 / 1e6, 4), "p99": round(p99 / 1e6, 4), "max": round(float(a.max()) / 1e6, 4),
            "n": int(a.size)}


def cross_modal_error(
    streams: dict[str, SyntheticStream], refs: dict[str, np.ndarray], *, warmup_s: float = 10.0,
    max_pair_ns: int = 500_000_000,
) -> dict[str, Any]:
    """Error of relative timing between modalities, against ground truth, after a warm-up.

    For every packet of source A (after `warmup_s`) and its nearest-in-true-time packet of B,
    when that one lies within `max_pair_ns` (a sensor silent for 30 s has no packet to align
    with): error = (ref_A - ref_B) - (true_A - true_B). Reported per pair and pooled, in ms.
    """
    start = min(int(s.true_ref_ns.min()) for s in streams.values()) + int(warmup_s * 1e9)
    pooled = []
    pairs: dict[str, dict[str, float]] = {}
    for a, b in itertools.combinations(sorted(streams), 2):
        sa, sb = streams[a], streams[b]
        keep = sa.true_ref_ns >= start
        ta = sa.true_ref_ns[keep]
        order = np.argsort(sb.true_ref_ns, kind="stable")
        tb = sb.true_ref_ns[order]
        k = np.clip(np.searchsorted(tb, ta), 1, tb.size - 1)
        nearer = np.where(np.abs(tb[k - 1] - ta) <= np.abs(tb[k] - ta), k - 1, k)
        jb = order[nearer]
        close = np.abs(sb.true_ref_ns[jb] - ta) <= max_pair_ns
        err = ((refs[a][keep] - refs[b][jb]) - (ta - sb.true_ref_ns[jb]))[close]
        pairs[f"{a}-{b}"] = _stats_ms(err)
        pooled.append(err)
    per_source = {
        sid: _stats_ms((refs[sid] - s.true_ref_ns)[s.true_ref_ns >= start]) for sid, s in streams.items()
    }
    return {"all": _stats_ms(np.concatenate(pooled)), "pairs": pairs, "absolute": per_source}


def set_report(streams: dict[str, SyntheticStream], sets: list[AlignedWindow], *, warmup_s: float = 10.0) -> dict[str, Any]:
    """Skew of the synchroniser's sets (reference time) and its error against the true skew."""
    start = min(int(s.true_ref_ns.min()) for s in streams.values()) + int(warmup_s * 1e9)
    skew, err = [], []
    complete = partial = 0
    for w in sets:
        members = [m[1] for ms in w.members.values() for m in ms]
        if w.missing:
            partial += 1
        else:
            complete += 1
        truth = [int(streams[sid].true_ref_ns[i]) for sid, i in members]
        if min(truth) < start:
            continue
        refs = [t for ms in w.members.values() for t, _ in ms]
        skew.append(w.skew_ns)
        rel_ref = np.array(refs) - refs[0]
        rel_true = np.array(truth) - truth[0]
        err.append(int(np.max(np.abs(rel_ref - rel_true))))
    return {"sets": len(sets), "complete": complete, "partial": partial,
            "skew_ms": _stats_ms(np.array(skew, dtype=np.int64)),
            "skew_error_ms": _stats_ms(np.array(err, dtype=np.int64))}
