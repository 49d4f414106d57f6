"""Offline (two-pass) alignment of a recorded JSONL event file onto the reference clock.

Pass 1 reads every line, validates it and keeps only numbers per source. The fit then runs
per source: the online `SourceClock` replays the source in arrival order to find its epochs
(resets) and outliers, and a single lower-envelope fit over *all* of the source's packets
(shared drift, one offset per epoch, `q` ~ 0.2 %) gives the final map - far tighter than the
online estimate because it sees the whole file. Pass 2 re-reads the file and writes every
valid event back, in input order, with all its fields plus `ref_ns`.

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

from tristream.core.clock import SourceClock
from tristream.core.envelope import fit_lower_envelope
from tristream.core.errors import InvalidPacket, TimeCoreError
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
    return source, start, start + dur, arrival


def _not_too_early(r: np.ndarray, early_ns: float) -> np.ndarray:
    """Mask of points that are not isolated below the dense lower tail of residuals `r`.

    Real minimum-delay points crowd just under the coarse line; a packet stamped late sits
    alone further below. Scanning the lowest 5 % of residuals upwards, the last gap wider than
    max(`early_ns` / 10, 20 x their median spacing) separates the two; everything under it (at
    most 5 % of the points) is dropped from the fine fit. Points more than `early_ns` below
    the coarse line are always dropped.
    """
    keep = r >= -early_ns
    n = r.size
    m = max(5, n // 20)
    if n < 20:
        return keep
    low = np.sort(r[keep])[:m]
    if low.size < 5:
        return keep
    gaps = np.diff(low)
    tol = max(early_ns / 10.0, 20.0 * float(np.median(gaps)))
    wide = np.flatnonzero(gaps > tol)
    if wide.size:
        keep &= r > low[wide[-1]]
    return keep


@dataclass(slots=True)
class SourceFit:
    """The offline map of one source and what was seen on the way."""

    source: str
    ref_ns: np.ndarray
    outlier: np.ndarray
    summary: dict[str, Any] = field(default_factory=dict)


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
) -> SourceFit:
    """Fit one source over its whole recording; returns `ref_ns` per packet (input order)."""
    n = int(start_ns.size)
    clock = SourceClock(source, latency_ns=latency_ns, max_drift_ppm=max_drift_ppm)
    online = np.zeros(n, dtype=np.int64)
    label = np.full(n, -1, dtype=np.int64)
    eps: list[object] = [None] * n
    for i in np.argsort(arrival_ns, kind="stable").tolist():
        online[i] = clock.observe_span(int(start_ns[i]), int(end_ns[i]), int(arrival_ns[i]))
        eps[i] = clock.last_epoch
    index = {id(e): k for k, e in enumerate(clock.epoch_history)}
    label[:] = [index.get(id(e), -1) for e in eps]
    ref = online.copy()
    hist = clock.epoch_history
    used = [k for k in range(len(hist)) if np.any(label == k)]
    gaps = np.zeros(0)
    slope = 0.0
    n_early = 0
    if used:
        sel = [np.flatnonzero(label == k) for k in used]
        xs = [(end_ns[ix] - hist[k].s0).astype(np.float64) for k, ix in zip(used, sel, strict=True)]
        ys = [(arrival_ns[ix] - hist[k].a0).astype(np.float64) - x for k, ix, x in zip(used, sel, xs, strict=True)]
        # Stage 1: a coarse fit at a higher quantile sits above a few too-early points; points more
        # than `early_ns` below it are implausible (stamped late) and left out of stage 2.
        coarse = fit_lower_envelope(xs, ys, q=0.05, slope_bound=max_drift_ppm * 1e-6, guess=clock._d,
                                    guess_width=50e-6)
        keep = [_not_too_early(y - c - coarse.slope * x, early_ns)
                for x, y, c in zip(xs, ys, coarse.intercepts, strict=True)]
        n_early = int(sum(int((~k).sum()) for k in keep))
        fit = fit_lower_envelope([x[k] for x, k in zip(xs, keep, strict=True)],
                                 [y[k] for y, k in zip(ys, keep, strict=True)],
                                 q=q, slope_bound=max_drift_ppm * 1e-6, guess=coarse.slope, guess_width=50e-6)
        slope = fit.slope
        gap_parts = []
        for k, ix, x, y, c in zip(used, sel, xs, ys, fit.intercepts, strict=True):
            xs_start = (start_ns[ix] - hist[k].s0).astype(np.float64)
            ref[ix] = hist[k].a0 + np.rint(c + (1.0 + slope) * xs_start).astype(np.int64) - latency_ns
            gap_parts.append(y - c - slope * x)
        gaps = np.concatenate(gap_parts)
    out_ix = np.flatnonzero(label < 0)
    last = hist[used[-1]] if used else None
    summary: dict[str, Any] = {
        "packets": n,
        "drift_ppm": round((1.0 / (1.0 + slope) - 1.0) * 1e6, 4),
        "offset_ns": int(ref[np.flatnonzero(label == used[-1])[0]] - start_ns[np.flatnonzero(label == used[-1])[0]])
        if last is not None else None,
        "epochs": len(hist),
        "resets": clock.counts["reset"],
        "outliers": int(out_ix.size),
        "too_early": n_early,
        "out_of_order": clock.counts["reordered"],
        "late": int(np.sum(gaps > late_ns)),
        "late_threshold_ms": late_ns / 1e6,
        "latency_ns": latency_ns,
    }
    if gaps.size:
        p50, p99 = np.percentile(gaps, [50, 99])
        summary["delay_above_min_ms"] = {"p50": round(p50 / 1e6, 4), "p99": round(p99 / 1e6, 4),
                                         "max": round(float(gaps.max()) / 1e6, 4)}
        summary["uncertainty_ns"] = round(float(p50) / max(1.0, math.sqrt(gaps.size)), 1)
    return SourceFit(source, ref, label < 0, summary)


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
) -> dict[str, Any]:
    """Two-pass alignment of `inp` into `out`; returns the per-source summary.

    A malformed line raises `AlignInputError` when `strict`, else is reported to `on_error`,
    counted and left out of the output.
    """
    latency_ns = latency_ns or {}
    per: dict[str, list[list[int]]] = {}
    line_src: list[tuple[str, int] | None] = []
    bad = 0
    with inp.open("r", encoding="utf-8") as fh:
        for no, line in _lines(fh, progress):
            if not line.strip():
                line_src.append(None)
                continue
            try:
                source, s0, s1, arr = parse_event(json.loads(line))
            except (json.JSONDecodeError, TimeCoreError, ValueError) as exc:
                msg = f"not valid JSON ({exc.msg} at column {exc.colno})" if isinstance(exc, json.JSONDecodeError) \
                    else str(exc)
                err = AlignInputError(no, msg)
                if strict:
                    raise err from exc
                bad += 1
                line_src.append(None)
                if on_error is not None:
                    on_error(err)
                continue
            cols = per.setdefault(source, [[], [], []])
            line_src.append((source, len(cols[0])))
            cols[0].append(s0)
            cols[1].append(s1)
            cols[2].append(arr)
    fits = {
        src: fit_source(src, np.array(c[0], np.int64), np.array(c[1], np.int64), np.array(c[2], np.int64),
                        latency_ns=latency_ns.get(src, 0))
        for src, c in per.items()
    }
    written = 0
    with inp.open("r", encoding="utf-8") as fh, out.open("w", encoding="utf-8") as fo:
        for (_, line), slot in zip(_lines(fh, progress), line_src, strict=True):
            if slot is None:
                continue
            obj = json.loads(line)
            f = fits[slot[0]]
            obj["ref_ns"] = int(f.ref_ns[slot[1]])
            if f.outlier[slot[1]]:
                obj["ref_flag"] = "outlier"
            fo.write(json.dumps(obj))
            fo.write("\n")
            written += 1
    return {
        "input": str(inp),
        "output": str(out),
        "lines": len(line_src),
        "written": written,
        "invalid_lines": bad,
        "sources": {s: f.summary for s, f in sorted(fits.items())},
    }
