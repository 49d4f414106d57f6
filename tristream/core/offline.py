"""Offline (two-pass) alignment of a recorded JSONL event file onto the reference clock.

Pass 1 reads every line, validates it and keeps only numbers per source. The fit then runs
per source, vectorised over the whole recording (`epochs.py`, `curve.py`): wrapping timestamps
are unwrapped, duplicates (the same capture again) set aside, epochs (resets) found from jumps
no delay explains, and each epoch's map is a piecewise-linear lower-envelope curve (knots every
5 s), so a drift that follows temperature or steps is followed. Pass 2 re-reads the file and
writes every valid event back, in input order, with all its fields plus `ref_ns` (and
`ref_flag`: `duplicate` - it gets its first copy's time - or `outlier`, placed from arrival).

Input line: {"source": "mic0", "ts": 48000, "unit": "samples@16000", "samples": 320,
"arrival_ns": 1000020456, ...}. `ts` is the first sample; the duration comes from `samples`
(with a `samples@RATE` unit, or a `sample_rate`/`rate_hz` field) or `duration_ns`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from tristream.core import jsonl
from tristream.core.curve import fit_lower_curve
from tristream.core.epochs import duplicates, segment_epochs, sorted_gaps, unwrap
from tristream.core.errors import InvalidPacket, TimeCoreError
from tristream.core.forkjoin import fork_map, free_cores, shared_empty
from tristream.core.units import parse_unit


class AlignInputError(TimeCoreError):
    """A malformed input line; `line` is 1-based."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.reason = message


def parse_event(obj: Any) -> tuple[str, int, int, int]:
    """Validate one decoded event; return (source, start ns, end ns, arrival ns) in source/ref ns."""
    if not isinstance(obj, dict):
        raise InvalidPacket(f"expected a JSON object, got {type(obj).__name__}")
    for key in ("source", "ts", "unit", "arrival_ns"):
        if key not in obj:
            raise InvalidPacket(f"missing field {key!r} (need source, ts, unit, arrival_ns)")
    source = obj["source"]
    if not isinstance(source, str) or not source:
        raise InvalidPacket(f"source {source!r} must be a non-empty string")
    unit = parse_unit(obj["unit"])
    start = unit.to_ns(obj["ts"])
    arrival = obj["arrival_ns"]
    if isinstance(arrival, float) and arrival.is_integer():
        arrival = int(arrival)
    if not isinstance(arrival, int) or isinstance(arrival, bool) or arrival < 0:
        raise InvalidPacket(f"arrival_ns {arrival!r} must be a non-negative integer (ns)")
    dur = 0
    if "duration_ns" in obj:
        d = obj["duration_ns"]
        if not isinstance(d, (int, float)) or isinstance(d, bool) or not math.isfinite(d) or d < 0:
            raise InvalidPacket(f"duration_ns {d!r} must be a non-negative number")
        dur = round(d)
    elif "samples" in obj:
        n = obj["samples"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidPacket(f"samples {n!r} must be a non-negative integer")
        rate = obj.get("sample_rate", obj.get("rate_hz"))
        if unit.is_sample_index and rate is None:
            rate = unit.ticks_per_s
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0:
            raise InvalidPacket(
                f"samples={n} but no sample rate: use a samples@RATE unit or add sample_rate (Hz)"
            )
        dur = round(n * 1e9 / rate)
    if not (-(1 << 62) < start and start + dur < (1 << 62) and arrival < (1 << 62)):
        raise InvalidPacket(f"ts {obj['ts']!r} / arrival_ns {arrival!r} out of range (at most 2**62 ns)")
    return source, start, start + dur, arrival


@dataclass(slots=True)
class SourceFit:
    """The offline map of one source and what was seen on the way."""

    source: str
    ref_ns: np.ndarray
    outlier: np.ndarray
    summary: dict[str, Any] = field(default_factory=dict)
    duplicate: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))


def fit_source(
    source: str,
    start_ns: np.ndarray,
    end_ns: np.ndarray,
    arrival_ns: np.ndarray,
    *,
    latency_ns: int = 0,
    q: float = 0.002,
    late_ns: int = 100_000_000,
    early_ns: int = 1_000_000,
    max_drift_ppm: float = 1000.0,
    wrap_ns: float = 0.0,
    knot_ns: float = 5e9,
    duplicate_window_ns: int = 2_000_000_000,
) -> SourceFit:
    """Fit one source over its whole recording; returns `ref_ns` per packet (input order).

    `wrap_ns` is the period after which the source timestamps wrap (`TimeUnit.wrap_ns`); `q`
    and `max_drift_ppm` are kept for callers of the straight-line fit and bound nothing here.
    """
    del q, max_drift_ppm
    start_ns = np.asarray(start_ns, np.int64)
    arrival_ns = np.asarray(arrival_ns, np.int64)
    n = int(start_ns.size)
    # a recording is written in arrival order (its stable sort is then the identity)
    in_order = bool(np.all(arrival_ns[1:] >= arrival_ns[:-1]))
    order = None if in_order else np.argsort(arrival_ns, kind="stable")
    arr = arrival_ns if order is None else arrival_ns[order]
    s_raw = start_ns if order is None else start_ns[order]
    dur = np.asarray(end_ns, np.int64) - start_ns if order is None else np.asarray(end_ns, np.int64)[order] - s_raw
    s, cycle = unwrap(s_raw, wrap_ns)
    e = s + dur
    by_start = np.argsort(s, kind="stable")  # for the duplicates and each epoch's gaps
    dup_of = duplicates(s, e, arr, duplicate_window_ns, by_start)
    live = np.flatnonzero(dup_of < 0)
    y_all = arr - e
    ep = segment_epochs(y_all[live], arr[live])
    label = np.full(n, -1, np.int64)
    label[live] = ep.label
    ref = np.zeros(n, np.int64)
    gaps_n = lost_n = wraps = reordered = 0
    resid: list[np.ndarray] = []
    slopes: list[np.ndarray] = []
    chord: list[tuple[float, float]] = []
    epochs_used = 0
    last_offset: int | None = None
    rejected = early_bins = 0
    for k in range(ep.count):
        ix = np.flatnonzero(label == k)
        if ix.size == 0:
            continue
        epochs_used += 1
        s0 = int(e[ix].min())
        x = (e[ix] - s0).astype(np.float64)
        y = y_all[ix].astype(np.float64)
        curve, info = fit_lower_curve(x, y, knot_ns=knot_ns, early_ns=early_ns,
                                      bin_ns=_bin_ns(x))
        rejected += info["rejected_bins"]
        early_bins += info["early_bins"]
        xs = (s[ix] - s0).astype(np.float64)
        ref[ix] = s[ix] + np.rint(curve(xs)).astype(np.int64) - latency_ns
        resid.append(y - curve(x))
        slopes.append(curve.slopes())
        chord.append((float(curve.values[-1] - curve.values[0]), float(curve.step * (curve.values.size - 1))))
        o = by_start[label[by_start] == k]  # the epoch's packets by start (ties in arrival order)
        g, lost, _ = sorted_gaps(s[o], e[o])
        gaps_n += g
        lost_n += lost
        wraps += int(cycle[ix].max() - cycle[ix].min())
        ei = e[ix]
        reordered += int(np.sum(ei < np.maximum.accumulate(ei)))
        j = ix[-1]
        last_offset = int(ref[j] - s_raw[j])
    gaps = np.concatenate(resid) if resid else np.zeros(0)
    p50 = float(np.median(gaps)) if gaps.size else 0.0
    out = np.flatnonzero((label < 0) & (dup_of < 0))
    ref[out] = arr[out] - dur[out] - latency_ns - round(p50)  # no clock to trust: placed from arrival
    d = np.flatnonzero(dup_of >= 0)
    ref[d] = ref[dup_of[d]]
    slope = np.concatenate(slopes) if slopes else np.zeros(1)
    ppm = (1.0 / (1.0 + slope) - 1.0) * 1e6
    run = sum(c[1] for c in chord)
    mean_slope = sum(c[0] for c in chord) / run if run > 0 else 0.0
    summary: dict[str, Any] = {
        "packets": n,
        "drift_ppm": round((1.0 / (1.0 + mean_slope) - 1.0) * 1e6, 4),
        "drift_ppm_range": [round(float(ppm.min()), 3), round(float(ppm.max()), 3)],
        "offset_ns": last_offset,
        "epochs": epochs_used,
        "resets": max(0, epochs_used - 1),
        "wraps": wraps,
        "duplicates": int(d.size),
        "gaps": gaps_n,
        "lost_packets": lost_n,
        "outliers": int(out.size),
        "too_early": int(np.sum(gaps < -early_ns)),
        "out_of_order": reordered,
        "delayed_excursions": ep.delayed,
        "late": int(np.sum(gaps > late_ns)),
        "late_threshold_ms": late_ns / 1e6,
        "latency_ns": latency_ns,
        "congested_bins": rejected,
    }
    if gaps.size:
        q50, q99 = np.percentile(gaps, [50, 99])
        summary["delay_above_min_ms"] = {"p50": round(q50 / 1e6, 4), "p99": round(q99 / 1e6, 4),
                                         "max": round(float(gaps.max()) / 1e6, 4)}
        summary["uncertainty_ns"] = round(float(q50) / max(1.0, math.sqrt(gaps.size)), 1)
    dup_mask = dup_of >= 0
    if order is None:
        return SourceFit(source, ref, (label < 0) & ~dup_mask, summary, dup_mask)
    inv = np.empty(n, np.int64)
    inv[order] = np.arange(n)
    return SourceFit(source, ref[inv], (label < 0)[inv] & ~dup_mask[inv], summary, dup_mask[inv])


def _bin_ns(x: np.ndarray) -> float:
    """Bins of about 12 packets, 0.25-2 s."""
    span = float(x.max() - x.min()) if x.size else 0.0
    rate = x.size / span if span > 0 else 0.0
    return float(np.clip(12.0 / rate, 0.25e9, 2e9)) if rate > 0 else 0.5e9


def _read_line(line: str, no: int, strict: bool, on_error: Callable[[AlignInputError], None] | None
               ) -> tuple[dict[str, Any], tuple[str, int, int, int]] | None:
    """One line (`no`, 1-based) through `json` and `parse_event`: its object and numbers, or None
    for a malformed one, which raises `AlignInputError` when `strict` and is else reported to
    `on_error`."""
    try:
        obj = json.loads(line)
        return obj, parse_event(obj)
    except (json.JSONDecodeError, TimeCoreError, ValueError) as exc:
        msg = f"not valid JSON ({exc.msg} at column {exc.colno})" if isinstance(exc, json.JSONDecodeError) \
            else str(exc)
        err = AlignInputError(no, msg)
        if strict:
            raise err from exc
        if on_error is not None:
            on_error(err)
        return None


def _with_ref(line: str, obj: dict[str, Any] | None, ref: int, flag: str | None) -> str:
    """An event's line with `ref_ns` (and `ref_flag`) and its newline: its own text with the
    fields appended (no second JSON round trip) when it ends with its brace and names neither,
    else its object (`obj`, or the line decoded again) through `json`."""
    text = line.rstrip()
    if text.endswith("}") and '"ref_ns"' not in text and '"ref_flag"' not in text:
        return text[:-1].rstrip() + f', "ref_ns": {ref}' + (f', "ref_flag": "{flag}"}}' if flag else "}") + "\n"
    if obj is None:
        obj = json.loads(line)
    obj["ref_ns"] = ref
    if flag:
        obj["ref_flag"] = flag
    return json.dumps(obj) + "\n"


def _lines(fh: IO[str], progress: Callable[[int], None] | None) -> Iterator[tuple[int, str]]:
    for no, line in enumerate(fh, 1):
        if progress is not None:
            progress(len(line))
        yield no, line


def align_file(
    inp: Path,
    out: Path,
    *,
    latency_ns: dict[str, int] | None = None,
    strict: bool = False,
    on_error: Callable[[AlignInputError], None] | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """Two-pass alignment of `inp` into `out`; returns the per-source summary.

    A malformed line raises `AlignInputError` when `strict`, else is reported to `on_error`,
    counted and left out of the output. Lines are decoded in bulk (`jsonl.scan`); the few that
    path does not take go through `json` and `parse_event`, which report errors. `workers`
    processes (default: one per free core, `forkjoin.free_cores`, at most 4; one for files under
    8 MB) share the decoding, the fits and the writing.
    """
    data = inp.read_bytes()
    if not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            data = b""
    if not data or b"\r" in data:
        return _align_text(inp, out, latency_ns=latency_ns, strict=strict, on_error=on_error, progress=progress)
    if workers is None:
        workers = min(free_cores(), 4) if len(data) >= 8 << 20 else 1
    latency_ns = latency_ns or {}
    sc = jsonl.scan(data, workers)
    if progress is not None:
        progress(len(data))
    n = sc.kind.size
    code = {name: k for k, name in enumerate(sc.sources)}
    src_of = np.where(sc.kind == 1, sc.source, -1)
    units = dict(sc.units)
    texts: dict[int, str] = {}
    bad = 0
    slow_lines = np.flatnonzero(sc.kind == 2).tolist()
    slow_obj: dict[int, dict[str, Any]] = {}
    for i in slow_lines:
        line = data[sc.starts[i] : sc.ends[i] + 1].decode("utf-8")  # with its newline, as a text file gives it
        if not line.strip():
            sc.kind[i] = 0
            continue
        got = _read_line(line, i + 1, strict, on_error)
        if got is None:
            bad += 1
            sc.kind[i] = 0
            continue
        obj, (source, s0, s1, arr) = got
        src_of[i] = code.setdefault(source, len(code))
        units.setdefault(source, str(obj["unit"]))
        sc.start_ns[i], sc.end_ns[i], sc.arrival_ns[i] = s0, s1, arr
        slow_obj[i] = obj
        texts[i] = line
    names = list(code)
    # written by the fits in forked children too (shared memory): only summaries come back
    ref = shared_empty(n, np.int64) if workers > 1 else np.zeros(n, np.int64)
    flag = shared_empty(n, np.int8) if workers > 1 else np.zeros(n, np.int8)
    flag[:] = 0
    fits: dict[str, dict[str, Any]] = {}
    order = np.argsort(src_of, kind="stable")
    bounds = np.searchsorted(src_of[order], np.arange(len(names) + 1) - 0.5)
    rows = {name: order[bounds[k] : bounds[k + 1]] for k, name in enumerate(names) if bounds[k + 1] > bounds[k]}

    def fit_group(group: list[str]) -> list[tuple[str, dict[str, Any]]]:
        done = []
        for name in group:
            ix = rows[name]
            f = fit_source(name, sc.start_ns[ix], sc.end_ns[ix], sc.arrival_ns[ix], latency_ns=latency_ns.get(name, 0),
                           wrap_ns=parse_unit(units[name]).wrap_ns if name in units else 0.0)
            ref[ix] = f.ref_ns
            flag[ix] = np.where(f.outlier, 1, np.where(f.duplicate, 2, 0))
            done.append((name, f.summary))
        return done

    # the largest sources first, each to the least loaded process
    groups: list[list[str]] = [[] for _ in range(max(1, min(workers, len(rows))))]
    load = [0] * len(groups)
    for name in sorted(rows, key=lambda nm: -rows[nm].size):
        g = load.index(min(load))
        groups[g].append(name)
        load[g] += int(rows[name].size)
    fits.update(item for got in fork_map(fit_group, groups) for item in got)
    for i, line in texts.items():
        texts[i] = _with_ref(line, slow_obj[i], int(ref[i]), ("outlier", "duplicate")[flag[i] - 1] if flag[i] else None)
    jsonl.write(out, data, sc, ref, flag, texts, workers)
    if progress is not None:
        progress(len(data))
    return {
        "input": str(inp),
        "output": str(out),
        "lines": n,
        "written": int(np.sum(sc.kind == 1)) + len(texts),
        "invalid_lines": bad,
        "sources": dict(sorted(fits.items())),
    }


def _align_text(
    inp: Path,
    out: Path,
    *,
    latency_ns: dict[str, int] | None = None,
    strict: bool = False,
    on_error: Callable[[AlignInputError], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """`align_file` line by line through `json` (files with CR line ends or invalid UTF-8)."""
    latency_ns = latency_ns or {}
    per: dict[str, list[list[int]]] = {}
    wrap: dict[str, float] = {}
    line_src: list[tuple[str, int] | None] = []
    bad = 0
    with inp.open("r", encoding="utf-8") as fh:
        for no, line in _lines(fh, progress):
            if not line.strip():
                line_src.append(None)
                continue
            got = _read_line(line, no, strict, on_error)
            if got is None:
                bad += 1
                line_src.append(None)
                continue
            obj, (source, s0, s1, arr) = got
            if source not in wrap:
                wrap[source] = parse_unit(obj["unit"]).wrap_ns
            cols = per.setdefault(source, [[], [], []])
            line_src.append((source, len(cols[0])))
            cols[0].append(s0)
            cols[1].append(s1)
            cols[2].append(arr)
    fits = {
        src: fit_source(src, np.array(c[0], np.int64), np.array(c[1], np.int64), np.array(c[2], np.int64),
                        latency_ns=latency_ns.get(src, 0), wrap_ns=wrap.get(src, 0.0))
        for src, c in per.items()
    }
    written = 0
    with inp.open("r", encoding="utf-8") as fh, out.open("w", encoding="utf-8") as fo:
        for (_, line), slot in zip(_lines(fh, progress), line_src, strict=True):
            if slot is None:
                continue
            f = fits[slot[0]]
            k = slot[1]
            flag = "outlier" if f.outlier[k] else "duplicate" if f.duplicate[k] else None
            fo.write(_with_ref(line, None, int(f.ref_ns[k]), flag))
            written += 1
    return {
        "input": str(inp),
        "output": str(out),
        "lines": len(line_src),
        "written": written,
        "invalid_lines": bad,
        "sources": {s: f.summary for s, f in sorted(fits.items())},
    }
