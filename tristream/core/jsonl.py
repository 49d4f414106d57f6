"""Reading and writing of `tristream align` event files (JSON Lines, one object a line).

`scan(data)` decodes a whole file with msgspec's typed decoder into the columns the fit needs
(source, start and end in source ns, arrival), blocks of lines at a time: a block whose lines
all start with `{` and end with `}` decodes as one stream of objects, which then match the
lines one to one (no object can span two such lines, so equal counts mean one object a line);
any other block goes line by line. A line the typed decoder refuses - invalid JSON, a missing
field, a float or out-of-range timestamp, a `null`, `NaN`, a negative sample count, an input
`ref_ns` - or whose numbers this path does not take (an unknown unit, an empty source, a
timestamp near the int64 range) is marked *slow*: the caller parses it with `json` and
`parse_event`, which give its value or its exact error. Valid lines parse to the numbers
`parse_event` gives.

`write(...)` writes the output: each fast line's own bytes up to its closing brace, then
`, "ref_ns": N` (and `, "ref_flag": "..."`) and the brace; slow lines' texts are spliced in
as given. A run of fast lines is one bytes `%` formatting of a template repeated per line.

With `workers > 1` both split the file into that many parts, decoded or written side by side
in forked processes (`forkjoin.fork_map`); the output does not depend on the split.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from tristream.core.errors import TimeCoreError
from tristream.core.forkjoin import fork_map, shared_empty
from tristream.core.units import TimeUnit, parse_unit

_BLOCK = 8192  # lines decoded as one stream (a refused line sends only its block line by line)
_LIM = 1 << 62
_SAFE = float(1 << 61)  # timestamps and durations beyond this go the exact (json) way


class _Event(msgspec.Struct, gc=False):
    """The fields `tristream align` reads; absent optional fields keep impossible defaults."""

    source: str
    ts: Annotated[int, msgspec.Meta(gt=-_LIM, lt=_LIM)]
    unit: str
    arrival_ns: Annotated[int, msgspec.Meta(ge=0, lt=_LIM)]
    samples: Annotated[int, msgspec.Meta(ge=0)] = -1
    sample_rate: Annotated[float, msgspec.Meta(gt=0)] = math.nan
    rate_hz: Annotated[float, msgspec.Meta(gt=0)] = math.nan
    duration_ns: Annotated[int, msgspec.Meta(ge=0, lt=_LIM)] = -1
    ref_ns: msgspec.UnsetType = msgspec.UNSET  # present in the input: rewritten the json way
    ref_flag: msgspec.UnsetType = msgspec.UNSET


_DECODER = msgspec.json.Decoder(_Event)
_NAMED_MAX = 64  # distinct sources and units a part's decoder is specialised for


def _named_decoder(sources: frozenset[str], units: frozenset[str]) -> msgspec.json.Decoder[Any]:
    """A decoder whose `source` and `unit` are `Literal`s of the values seen so far: each line's
    strings are then the literals' own objects (no allocation, hashes cached); a block with a new
    value fails and is decoded generically, which adds the value."""
    src_t: Any = Literal[tuple(sorted(sources))]
    unit_t: Any = Literal[tuple(sorted(units))]
    fields = [(f, src_t if f == "source" else unit_t if f == "unit" else _Event.__annotations__[f],
               getattr(_PLACEHOLDER, f) if f not in ("source", "ts", "unit", "arrival_ns") else msgspec.NODEFAULT)
              for f in _Event.__struct_fields__]
    named = msgspec.defstruct("_NamedEvent", fields, gc=False)
    return msgspec.json.Decoder(named)
_PLACEHOLDER = _Event("", 0, "ns", 0)  # stands in for a refused line (its empty source marks it slow)
_FMT = (b'%s, "ref_ns": %d}\n', b'%s, "ref_ns": %d, "ref_flag": "outlier"}\n',
        b'%s, "ref_ns": %d, "ref_flag": "duplicate"}\n')
_SUF = b', "ref_ns": %d}\n'
_SUF_BRACE = b', "ref_ns": %d}'
_SUFFIX = np.array([len(f % (b"", 0)) - 1 for f in _FMT], np.int64)  # bytes besides the body and the digits
_POW10 = np.array([10**k for k in range(1, 19)], np.int64)
# Lines formatted by one bytes `%` (about 2 MB of text): blocks of 65,536 lines cost 15 % more CPU
# in the writing (each 9 MB template and output is fresh memory from the kernel; smaller ones reuse it)
_RUN = 1 << 14
# buffers one writev takes, and the bytes after which a batch goes out (a plain run's text alone)
_IOV = min(1024, os.sysconf("SC_IOV_MAX")) if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 16
_IOV_BYTES = 1 << 20


@dataclass(slots=True)
class Scan:
    """Per line of a file: kind (0 blank, 1 parsed here, 2 for `json`), and the parsed columns."""

    starts: np.ndarray
    ends: np.ndarray
    kind: np.ndarray
    source: np.ndarray  # index into `sources` (fast lines)
    start_ns: np.ndarray
    end_ns: np.ndarray
    arrival_ns: np.ndarray
    close: np.ndarray  # position of the line's closing brace (fast lines)
    sources: list[str] = field(default_factory=list)
    units: dict[str, str] = field(default_factory=dict)  # first unit seen per source


def _blocks(data: bytes, starts: np.ndarray, ends: np.ndarray, shaped: np.ndarray,
            good: np.ndarray) -> Iterator[tuple[int, int, list[Any]]]:
    """The events of lines [starts, ends) by blocks (first line, end, events), a placeholder where
    the typed decoder refuses a line (and `good` cleared there)."""
    mv = memoryview(data)
    m = starts.size
    named: msgspec.json.Decoder[Any] | None = None
    sources: frozenset[str] = frozenset()
    units: frozenset[str] = frozenset()
    for i in range(0, m, _BLOCK):
        j = min(m, i + _BLOCK)
        if shaped[i:j].all():
            block = mv[int(starts[i]) : int(ends[j - 1])]
            got: list[Any] = []
            if named is not None:
                try:
                    got = named.decode_lines(block)
                except msgspec.DecodeError:
                    got = []
            if len(got) != j - i:
                try:
                    got = _DECODER.decode_lines(block)
                except msgspec.DecodeError:
                    got = []
                if len(got) == j - i:
                    new_s = sources | set(map(attrgetter("source"), got))
                    new_u = units | set(map(attrgetter("unit"), got))
                    if (new_s != sources or new_u != units) and len(new_s) <= _NAMED_MAX and len(new_u) <= _NAMED_MAX:
                        sources, units = new_s, new_u
                        named = _named_decoder(sources, units)
            if len(got) == j - i:
                yield i, j, got
                continue
        events: list[Any] = []
        for k, a, b in zip(range(i, j), starts[i:j].tolist(), ends[i:j].tolist(), strict=True):
            try:
                events.append(_DECODER.decode(mv[a:b]))
            except msgspec.DecodeError:
                events.append(_PLACEHOLDER)
                good[k] = False
        yield i, j, events


def _decode(data: bytes, starts: np.ndarray, ends: np.ndarray, shaped: np.ndarray) -> dict[str, Any]:
    """The columns of lines [starts, ends): `good` (the typed decoder took the line), the numeric
    fields (defaults where absent or refused), and dense codes of the sources (`source`, names in
    `sources`) and units (`unit`, `unit_names`) in order of first appearance.

    Each block's events are taken apart as soon as they are decoded, while they are in cache (the
    same passes over the whole file's objects, some 100 MB, cost 40 % more), each field by a list
    comprehension (a specialised attribute load: 20 % less than `map` of an `attrgetter`)."""
    m = starts.size
    good = np.ones(m, bool)
    ts, arr, samp, dur = (np.empty(m, np.int64) for _ in range(4))
    sr, rh = np.empty(m, np.float64), np.empty(m, np.float64)
    first = np.empty(m, np.int64)  # per line: the first line with its (source, unit)
    table: dict[tuple[str, str], int] = {}
    code = table.setdefault
    for i, j, events in _blocks(data, starts, ends, shaped, good):
        n = j - i
        first[i:j] = np.fromiter([code((e.source, e.unit), k) for k, e in enumerate(events, i)], np.int64, n)
        ts[i:j] = np.fromiter([e.ts for e in events], np.int64, n)
        arr[i:j] = np.fromiter([e.arrival_ns for e in events], np.int64, n)
        samp[i:j] = np.fromiter([e.samples for e in events], np.int64, n)
        dur[i:j] = np.fromiter([e.duration_ns for e in events], np.int64, n)
        sr[i:j] = np.fromiter([e.sample_rate for e in events], np.float64, n)
        rh[i:j] = np.fromiter([e.rate_hz for e in events], np.float64, n)
    cols = {"ts": ts, "arrival_ns": arr, "samples": samp, "duration_ns": dur, "sample_rate": sr, "rate_hz": rh}
    # dense codes of the (source, unit) pairs, then of their sources and units, each in order of
    # first appearance (the pairs are, so the first pair with a source is where it first appears)
    pair_first = np.fromiter(table.values(), np.int64, len(table))
    pair = np.searchsorted(pair_first, first)
    by_source: dict[str, int] = {}
    by_unit: dict[str, int] = {}
    ps = np.array([by_source.setdefault(src, len(by_source)) for src, _ in table], np.int64)
    pu = np.array([by_unit.setdefault(unit, len(by_unit)) for _, unit in table], np.int64)
    return {**cols, "good": good, "source": ps[pair], "unit": pu[pair], "sources": list(by_source),
            "unit_names": list(by_unit), "pair_first": pair_first, "pair_source": ps, "pair_unit": pu}


def _scan_part(data: bytes, lo: int, hi: int) -> dict[str, Any]:
    """Decode the lines of data[lo:hi] (lo at a line start, hi after a newline or at the end)."""
    buf = np.frombuffer(data, np.uint8, count=hi - lo, offset=lo)
    # newlines a MB at a time: one comparison over the whole part would take a fresh bool array
    # of its size from the kernel, page by page (5x the time of the search itself on a fresh process)
    step = 1 << 20
    nl = np.concatenate([np.flatnonzero(buf[a : a + step] == 10) + (a + lo) for a in range(0, buf.size, step)]
                        or [np.zeros(0, np.int64)])
    starts = np.r_[lo, nl + 1].astype(np.int64)
    ends = np.r_[nl, hi].astype(np.int64)
    if starts[-1] == hi:
        starts, ends = starts[:-1], ends[:-1]
    nonempty = ends > starts
    first = buf[np.minimum(starts - lo, max(hi - lo - 1, 0))]
    last = buf[np.maximum(ends - 1 - lo, 0)]
    shaped = nonempty & (first == ord("{")) & (last == ord("}"))
    dec = _decode(data, starts, ends, shaped)
    good = dec["good"]
    close = ends - 1
    for k in np.flatnonzero(good & ~shaped).tolist():  # a valid object with blanks around it
        a, b = int(starts[k]), int(ends[k])
        close[k] = a + len(data[a:b].rstrip(b" \t\r\n")) - 1
    src, names = dec["source"], dec["sources"]
    uc, unit_names = dec["unit"], dec["unit_names"]
    units: list[TimeUnit | None] = []
    for u in unit_names:
        try:
            units.append(parse_unit(u))
        except (TimeCoreError, ValueError):
            units.append(None)
    ts, arr = dec["ts"], dec["arrival_ns"]
    samp, sr, rh, dur_i = dec["samples"], dec["sample_rate"], dec["rate_hz"], dec["duration_ns"]
    known = np.array([u is not None for u in units], bool)
    tps = np.array([u.ticks_per_s if u is not None else 1 for u in units], np.int64)[uc]
    is_si = np.array([u is not None and u.is_sample_index for u in units], bool)[uc]
    bad = ~good | ~known[uc] | (tps > 1 << 33)
    empty = np.array([not s for s in names], bool)
    bad |= empty[src]
    # durations as parse_event computes them: duration_ns, else samples over the first rate given
    rate = np.where(~np.isnan(sr), sr, np.where(~np.isnan(rh), rh, np.where(is_si, tps.astype(np.float64), np.nan)))
    has_d, has_s = dur_i >= 0, samp >= 0
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        dur_f = np.rint(samp * 1e9 / rate)
        from_s = has_s & ~has_d
        bad |= from_s & ~(np.abs(dur_f) < _SAFE)
        dur = np.where(has_d, dur_i, np.where(from_s & ~bad, dur_f, 0.0).astype(np.int64))
        bad |= ~(np.abs(ts / tps.astype(np.float64)) * 1e9 < _SAFE) | (dur_i >= _SAFE)
    # ts in ns of the source clock (exact integer conversion, as TimeUnit.to_ns)
    t = np.where(bad, 0, ts)
    whole, rest = np.divmod(t, tps)
    start = np.where(tps == 1_000_000_000, t, whole * 1_000_000_000 + (rest * 1_000_000_000 + tps // 2) // tps)
    ok = ~bad
    # the unit of each source's first valid line: the unit of its first line when that one is valid
    first_line: dict[int, tuple[int, int]] = {}  # source code -> (its first line, unit code there)
    for k, c, u in zip(dec["pair_first"].tolist(), dec["pair_source"].tolist(), dec["pair_unit"].tolist(), strict=True):
        if names[c]:
            first_line.setdefault(c, (k, u))
    if all(ok[k] for k, _ in first_line.values()):
        unit_at = {c: u for c, (_, u) in first_line.items()}
    else:
        okx = np.flatnonzero(ok)
        first_ok = np.full(len(names), okx.size, np.int64)
        np.minimum.at(first_ok, src[okx], np.arange(okx.size))
        unit_at = {c: int(uc[okx[k]]) for c, k in enumerate(first_ok.tolist()) if k < okx.size}
    unit_of = {names[c]: unit_names[unit_at[c]] for c in sorted(unit_at)}
    return {"starts": starts, "ends": ends, "kind": np.where(bad, 2, 1).astype(np.int8), "source": src,
            "names": names, "start_ns": start, "end_ns": start + dur, "arrival_ns": arr,
            "close": close, "units": unit_of}


def _cuts(data: bytes, parts: int) -> list[tuple[int, int]]:
    """`parts` byte ranges of data, each starting at a line start."""
    bounds = [0]
    for p in range(1, parts):
        k = data.find(b"\n", max(bounds[-1], len(data) * p // parts))
        if k < 0:
            break
        bounds.append(k + 1)
    bounds.append(len(data))
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


_COLUMNS = {"starts": np.int64, "ends": np.int64, "kind": np.int8, "source": np.int64, "start_ns": np.int64,
            "end_ns": np.int64, "arrival_ns": np.int64, "close": np.int64}


def scan(data: bytes, workers: int = 1) -> Scan:
    """Decode a whole JSONL file (bytes); see the module docstring."""
    cuts = _cuts(data, max(1, workers)) or [(0, 0)]
    # the parts decoded in forked children write their columns into memory shared with this process
    shared: list[dict[str, np.ndarray] | None] = [None]
    for lo, hi in cuts[1:]:
        m = data.count(b"\n", lo, hi) + (data[hi - 1] != 10)
        shared.append({k: shared_empty(m, dt) for k, dt in _COLUMNS.items()})

    def run(k: int) -> dict[str, Any]:
        got = _scan_part(data, *cuts[k])
        out = shared[k]
        if out is None:
            return got
        for key, col in out.items():
            col[:] = got.pop(key)
        return got

    parts = fork_map(run, range(len(cuts)))
    for p, out in zip(parts, shared, strict=True):
        if out is not None:
            p.update(out)
    sources: list[str] = []
    gcode: dict[str, int] = {}
    units: dict[str, str] = {}
    remapped = []
    for p in parts:
        table = np.array([gcode.setdefault(s, len(gcode)) if s else -1 for s in p["names"]] or [-1], np.int64)
        remapped.append(table[p["source"]] if p["source"].size else p["source"])
        for s, u in p["units"].items():
            units.setdefault(s, u)
    sources = list(gcode)

    def cat(key: str) -> np.ndarray:
        return np.concatenate([p[key] for p in parts])

    return Scan(cat("starts"), cat("ends"), cat("kind"), np.concatenate(remapped), cat("start_ns"), cat("end_ns"),
                cat("arrival_ns"), cat("close"), sources, units)


def _digits(v: np.ndarray) -> np.ndarray:
    """Characters of each integer in decimal (with its sign)."""
    return 1 + np.searchsorted(_POW10, np.abs(v), side="right") + (v < 0)


def _template(text: bytes, lines: int) -> bytes:
    """The `%` template of `lines` contiguous lines that each end with their brace: "}\n" replaced
    by the suffix. When each line's closing brace is its only one (no nested object, no brace in a
    string), replacing the braces alone gives the same bytes in a quarter of the time (a search
    for one byte instead of two). The braces are counted by numpy (`bytes.count` of one byte
    takes 2.5 times as long)."""
    if int(np.count_nonzero(np.frombuffer(text, np.uint8) == 125)) == lines:  # 125: "}"
        return text.replace(b"}", _SUF_BRACE)
    return text.replace(b"}\n", _SUF)


def _render(data: bytes, sc: Scan, ref: np.ndarray, flag: np.ndarray, texts: dict[int, bytes], size: np.ndarray,
            a: int, b: int) -> Iterator[bytes | memoryview]:
    """The output of lines [a, b), in pieces; `size` is each line's output size."""
    slow = (np.flatnonzero(sc.kind[a:b] != 1) + a).tolist()
    i = a
    for k in [*slow, b]:
        for j0 in range(i, k, _RUN):  # a run of fast lines, formatted in one go
            j1 = min(k, j0 + _RUN)
            c = sc.close[j0:j1]
            f = flag[j0:j1]
            if np.array_equal(c, sc.ends[j0:j1] - 1) and np.array_equal(sc.starts[j0 + 1 : j1], sc.ends[j0 : j1 - 1] + 1):
                # Contiguous lines that each end with their brace: "}\n" occurs only at their ends, so
                # the run's own text, with "}\n" replaced by the suffix, is the template.
                lo, hi = int(sc.starts[j0]), int(sc.ends[j1 - 1])
                text = data[lo : hi + 1] if hi < len(data) else data[lo:hi] + b"\n"
                if b"%" in text:
                    text = text.replace(b"%", b"%%")
                refs = ref[j0:j1].tolist()
                out = _template(text, j1 - j0) % tuple(refs)
                if not f.any():
                    yield out
                    continue
                # Flagged lines (duplicates, outliers) are few: the run is formatted as above and
                # written around them (views of it), each flagged one formatted on its own (one
                # template with a flag field per line costs 3x; a template per stretch between
                # them, 30 % more for the whole file).
                flagged = np.flatnonzero(f)
                # where each line ends in `out`: its size in the output less the flag's field
                at = np.cumsum(size[j0:j1] - (_SUFFIX[f] - _SUFFIX[0]))
                view = memoryview(out)
                p = 0
                for q, lo_q, hi_q in zip(flagged.tolist(), (at[flagged] - size[flagged + j0] + _SUFFIX[f[flagged]]
                                                            - _SUFFIX[0]).tolist(), at[flagged].tolist(), strict=True):
                    if lo_q > p:
                        yield view[p:lo_q]
                    yield _FMT[int(f[q])] % (data[int(sc.starts[j0 + q]) : int(c[q])], refs[q])
                    p = hi_q
                if p < len(out):
                    yield view[p:]
                continue
            bodies = list(map(data.__getitem__, map(slice, sc.starts[j0:j1].tolist(), c.tolist())))
            tmpl = _FMT[0] * (j1 - j0) if not f.any() else b"".join(map(_FMT.__getitem__, f.tolist()))
            args: list[Any] = [None] * (2 * (j1 - j0))
            args[0::2] = bodies
            args[1::2] = ref[j0:j1].tolist()
            yield tmpl % tuple(args)
        if k < b and k in texts:
            yield texts[k]
        i = k + 1


def _put(fd: int, pieces: Iterator[bytes | memoryview], off: int | None) -> int:
    """Write `pieces` at `off` (or at the file position when None); returns the bytes written.
    Pieces go out in batches of up to `_IOV` buffers, one `writev` each: the lines around flagged
    ones come in thousands of small pieces, and a system call each cost 30 ms over a file."""
    total = 0
    batch: list[bytes | memoryview] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece)
        if len(batch) >= _IOV or size >= _IOV_BYTES:
            total += _put_batch(fd, batch, size, None if off is None else off + total)
            batch, size = [], 0
    if batch:
        total += _put_batch(fd, batch, size, None if off is None else off + total)
    return total


def _put_batch(fd: int, batch: list[bytes | memoryview], size: int, off: int | None) -> int:
    """Write the buffers of `batch` (`size` bytes in all) at `off` or the file position."""
    if off is None:
        k = os.writev(fd, batch)
    elif hasattr(os, "pwritev"):
        k = os.pwritev(fd, batch, off)
    else:
        k = 0
    if k < size:  # a short write (or no pwritev): the rest in a loop
        view = memoryview(b"".join(batch))[k:]
        while view:
            w = os.write(fd, view) if off is None else os.pwrite(fd, view, off + k)
            view = view[w:]
            k += w
    return size


def write(path: Path, data: bytes, sc: Scan, ref: np.ndarray, flag: np.ndarray, texts: dict[int, str],
          workers: int = 1) -> int:
    """Write the output file (see the module docstring); returns its size in bytes.

    Fast lines (kind 1) get `ref_ns` (and `ref_flag` 1 outlier / 2 duplicate) appended to their
    own text; lines in `texts` are written as given; other lines are left out. Each part of the
    lines is rendered and written at its own offset of the file."""
    tb = {i: t.encode("utf-8") for i, t in texts.items()}
    n = sc.kind.size
    size = np.where(sc.kind == 1, sc.close - sc.starts + _SUFFIX[flag] + _digits(ref), 0)
    for i, t in tb.items():
        size[i] = len(t)
    ends = np.cumsum(size)
    total = int(ends[-1]) if n else 0
    # A regular file is set to its final size rather than truncated on opening: ext4 writes back
    # a file truncated to zero and written again when it is closed (`auto_da_alloc`), 40 ms of
    # the closing call for an hour's recording; an existing file's pages are also overwritten in
    # place instead of freed and taken again.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular:
            os.ftruncate(fd, total)
        if not regular or workers <= 1 or n < 2:
            return _put(fd, _render(data, sc, ref, flag, tb, size, 0, n), None)
        cut = [0, *np.searchsorted(ends, [total * p // workers for p in range(1, workers)]).tolist(), n]
        spans = sorted({(a, b) for a, b in zip(cut[:-1], cut[1:], strict=True) if b > a})

        def part(ab: tuple[int, int]) -> int:
            a, b = ab
            off = int(ends[a - 1]) if a else 0
            done = _put(fd, _render(data, sc, ref, flag, tb, size, a, b), off)
            if done != int(ends[b - 1]) - off:
                raise RuntimeError(f"wrote {done} bytes for lines {a}-{b}; expected {int(ends[b - 1]) - off}")
            return done

        return sum(fork_map(part, spans))
    finally:
        os.close(fd)
