"""Vectorised reading and writing of `tristream align` event files (JSON Lines, one flat object a line).

`scan(data)` tokenises a whole file with numpy: string boundaries from the quote positions,
the structural characters outside strings, keys compared as bytes, number literals checked by
a small vectorised automaton of the JSON number grammar and parsed exactly (integers by Horner
in int64, decimals by numpy's correctly rounded conversion, as `json` does). A line that is not
provably a valid flat object with the fields in the shapes this path handles - escapes, nested
values, control characters, duplicate keys, a float timestamp, an unknown unit, a missing
field - is marked *slow*: the caller parses it with `json` and reports its exact error. Valid
lines parse to the same numbers `parse_event` gives.

`render(...)` writes the output: each fast line's own bytes up to its closing brace, then
`, "ref_ns": N` (and `, "ref_flag": "..."`) and the brace; slow lines' texts are spliced in
as given. The scan runs over chunks of lines, so its memory stays a few times the chunk.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tristream.core.errors import TimeCoreError
from tristream.core.units import TimeUnit, parse_unit

_CHUNK_LINES = 1 << 15
_KEYS = {b"source": 0, b"ts": 1, b"unit": 2, b"arrival_ns": 3, b"samples": 4, b"sample_rate": 5, b"rate_hz": 6,
         b"duration_ns": 7, b"ref_ns": 8, b"ref_flag": 9}
_NKEYS = len(_KEYS)
_WS = np.zeros(256, bool)
_WS[[9, 10, 13, 32]] = True
_CLASS = np.zeros(256, np.int8)  # 1 structure, 2 newline, 3 control character
_CLASS[:32] = 3
_CLASS[[ord(c) for c in '":,{}[]']] = 1
_CLASS[10] = 2
# JSON number automaton: classes 0 '0', 1 '1'-'9', 2 '-', 3 '+', 4 '.', 5 'e'/'E', 6 other, 7 end (padding)
_CLS = np.full(256, 6, np.int8)
_CLS[ord("0")] = 0
_CLS[ord("1") : ord("9") + 1] = 1
_CLS[ord("-")] = 2
_CLS[ord("+")] = 3
_CLS[ord(".")] = 4
_CLS[[ord("e"), ord("E")]] = 5
_CLS[0] = 7
# states: 0 start, 1 '-', 2 '0', 3 int, 4 '.', 5 frac, 6 'e', 7 exp sign, 8 exp digits, 9 accept, 10 reject
_T = np.full((11, 8), 10, np.int8)
_T[0, [0, 1, 2]] = [2, 3, 1]
_T[1, [0, 1]] = [2, 3]
_T[2, [4, 5, 7]] = [4, 6, 9]
_T[3, [0, 1, 4, 5, 7]] = [3, 3, 4, 6, 9]
_T[4, [0, 1]] = [5, 5]
_T[5, [0, 1, 5, 7]] = [5, 5, 6, 9]
_T[6, [0, 1, 2, 3]] = [8, 8, 7, 7]
_T[7, [0, 1]] = [8, 8]
_T[8, [0, 1, 7]] = [8, 8, 9]
_T[9, :] = 9
_NAMES_LOCK = threading.Lock()
_LIT = 24  # longest literal the fast path reads
_PAD = 64


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


def _lines(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nl = np.flatnonzero(buf == 10)
    starts = np.r_[0, nl + 1]
    ends = np.r_[nl, buf.size]
    if starts[-1] == buf.size:  # the file ends with a newline
        starts, ends = starts[:-1], ends[:-1]
    return starts.astype(np.int64), ends.astype(np.int64)


def _gather(buf: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """Rows of `width` bytes from `pos` (the buffer is padded, so rows never run off its end)."""
    return np.lib.stride_tricks.sliding_window_view(buf, width)[pos]


def _blank(buf: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """True where buf[a:b] is at most three blanks (longer runs go the json way)."""
    n = b - a
    ok = (n >= 0) & (n <= 3)
    for k in range(3):
        ok &= (k >= n) | _WS[buf[a + k]]
    return ok


def _ints(mat: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Integers from left-aligned digit rows (optional leading '-'), exact in int64 (<= 18 digits)."""
    neg = mat[:, 0] == ord("-")
    v = np.zeros(mat.shape[0], np.int64)
    for k in range(mat.shape[1]):
        take = (k >= neg) & (k < length)
        if not take.any():
            break
        v = np.where(take, v * 10 + (mat[:, k].astype(np.int64) - 48), v)
    return np.where(neg, -v, v)


def scan(data: bytes, workers: int = 1) -> Scan:
    """Tokenise a whole JSONL file (bytes); see the module docstring."""
    buf = np.frombuffer(data + bytes(_PAD), np.uint8)
    starts, ends = _lines(buf[: len(data)])
    n = starts.size
    out = Scan(starts, ends, np.full(n, 2, np.int8), np.zeros(n, np.int64), np.zeros(n, np.int64),
               np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64))
    if n == 0 or b"\\" in data:
        return out
    names: dict[bytes, int] = {}
    unit_cache: dict[bytes, TimeUnit | None] = {}
    spans = [(a, min(n, a + _CHUNK_LINES)) for a in range(0, n, _CHUNK_LINES)]
    if workers > 1 and len(spans) > 1:
        # numpy releases the GIL in the bulk work, so chunks scan side by side (the shared name
        # tables are updated under a lock)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda ab: _scan_chunk(buf, out, ab[0], ab[1], names, unit_cache), spans))
    else:
        for a, b in spans:
            _scan_chunk(buf, out, a, b, names, unit_cache)
    out.sources = [k.decode("utf-8") for k in names]
    return out


def _scan_chunk(buf: np.ndarray, out: Scan, a: int, b: int, names: dict[bytes, int],
                unit_cache: dict[bytes, TimeUnit | None]) -> None:
    lo, hi = int(out.starts[a]), int(out.ends[b - 1])
    chunk = buf[lo : hi + _PAD]  # `buf` is padded with zeros: gathers never run off the end
    size = hi - lo
    ls, le = out.starts[a:b] - lo, out.ends[a:b] - lo
    m = b - a
    bad = np.zeros(m, bool)
    # every interesting byte in one pass: structure, newlines, control characters
    pos = np.flatnonzero(_CLASS[chunk[:size]])
    cls = _CLASS[chunk[pos]]
    nl = cls == 2
    tline_all = np.cumsum(nl, dtype=np.int32) - nl  # line (in chunk) of every token
    ctrl = cls == 3
    if ctrl.any():
        bad[tline_all[ctrl]] = True
    keep = cls == 1
    pos, line_tok = pos[keep], tline_all[keep]
    ch = chunk[pos]
    isq = ch == 34
    outside = ~isq & (np.cumsum(isq, dtype=np.int32) % 2 == 0)
    qpos = pos[isq]
    qline = line_tok[isq]
    if qpos.size % 2 or np.any(qline[0::2] != qline[1::2]):
        # an odd number of quotes somewhere: mark every line with an odd count, re-pair per line
        cnt = np.bincount(qline, minlength=m)
        bad |= cnt % 2 == 1
        keep_q = ~bad[qline]
        qpos, qline = qpos[keep_q], qline[keep_q]
        keep_t = ~bad[line_tok]
        pos, ch, line_tok = pos[keep_t], ch[keep_t], line_tok[keep_t]
        isq = ch == 34
        outside = ~isq & (np.cumsum(isq, dtype=np.int32) % 2 == 0)
    s_open, s_close = qpos[0::2], qpos[1::2]  # string i is chunk[s_open+1 : s_close]
    s_line = qline[0::2]
    tpos = pos[outside]
    tch = ch[outside]
    tline = line_tok[outside]
    # Structure outside strings must be  { : , : , ... : }  per line.
    tcount = np.bincount(tline, minlength=m)
    first = np.r_[0, np.cumsum(tcount)[:-1]]
    rank = np.arange(tpos.size) - first[tline]
    last = rank == tcount[tline] - 1
    expect = np.where(rank == 0, ord("{"), np.where(last, ord("}"), np.where(rank % 2 == 1, ord(":"), ord(","))))
    bad[tline[tch != expect]] = True
    bad |= (tcount < 3) | (tcount % 2 == 0)
    # strings between consecutive structural tokens: a key before each ':', at most one value before ',' / '}'
    s_tok = np.searchsorted(tpos, s_open)  # index of the first structural token after the string
    s_rank = s_tok - first[s_line]
    is_key = (s_rank % 2 == 1) & (s_rank < tcount[s_line])
    per_slot = np.bincount(s_tok, minlength=tpos.size + 1)[: tpos.size]
    key_slot = (rank % 2 == 1) & ~last  # ':' tokens: exactly one string (the key) before them
    bad[tline[key_slot & (per_slot != 1)]] = True
    bad[tline[~key_slot & (rank > 0) & (per_slot > 1)]] = True
    bad[tline[(rank == 0) & (per_slot > 0)]] = True
    # Whitespace only around the tokens: before '{', after '}', around keys and string values.
    open_tok = tpos[rank == 0]
    close_tok = tpos[last]
    lines_t = tline[rank == 0]
    pre_ok = _blank(chunk, ls[lines_t], open_tok)
    post_ok = _blank(chunk, close_tok + 1, le[lines_t])
    bad[lines_t[~(pre_ok & post_ok)]] = True
    prev_tok = tpos[np.maximum(s_tok - 1, 0)]
    next_tok = tpos[np.minimum(s_tok, tpos.size - 1)]
    ws_before = _blank(chunk, prev_tok + 1, s_open)
    ws_after = _blank(chunk, s_close + 1, next_tok)
    bad[s_line[~(ws_before & ws_after)]] = True
    # Keys
    klen = s_close - s_open - 1
    kid = np.full(s_open.size, -1, np.int64)
    for name, k in _KEYS.items():
        cand = np.flatnonzero(is_key & (klen == len(name)))
        if cand.size:
            mat = _gather(chunk, s_open[cand] + 1, len(name))
            hit = np.all(mat == np.frombuffer(name, np.uint8), axis=1)
            kid[cand[hit]] = k
    keys = np.flatnonzero(is_key)
    kk = kid[keys]
    known = kk >= 0
    slot = s_line[keys[known]] * _NKEYS + kk[known]
    seen = np.bincount(slot, minlength=m * _NKEYS).reshape(m, _NKEYS)
    bad |= np.any(seen > 1, axis=1) | np.any(seen[:, [0, 1, 2, 3]] == 0, axis=1) | np.any(seen[:, [8, 9]] > 0, axis=1)
    # Values: the token after each key's ':' ends the value; a string value is the next string.
    colon = s_tok[keys]  # token index of the ':' after each key
    vend = tpos[np.minimum(colon + 1, tpos.size - 1)]
    vstart = tpos[colon] + 1
    nxt = np.minimum(keys + 1, s_open.size - 1)
    vstr = (s_open[nxt] > tpos[colon]) & (s_open[nxt] < vend) & (keys + 1 < s_open.size)
    # literals: strip up to 3 blanks each side, no blank inside, grammar checked
    lit = np.flatnonzero(~vstr)
    l0 = vstart[lit].copy()
    for _ in range(3):
        l0 += _WS[chunk[np.minimum(l0, chunk.size - 1)]] & (l0 < vend[lit])
    l1 = vend[lit].copy()
    for _ in range(3):
        l1 -= _WS[chunk[np.maximum(l1 - 1, 0)]] & (l1 > l0)
    llen = l1 - l0
    lline = s_line[keys[lit]]
    # (blanks beyond three, or inside, leave a blank in the literal, which the grammar refuses)
    okl = (llen > 0) & (llen <= _LIT)
    mat = _gather(chunk, l0, _LIT)
    mat[np.arange(_LIT) >= llen[:, None]] = 0
    # plain integers (the common case) directly; anything else through the number automaton
    dig = (mat - 48) < 10
    neg0 = mat[:, 0] == ord("-")
    ndig = dig.sum(axis=1)
    lead = mat[np.arange(lit.size), neg0.astype(np.int64)]
    nxt_d = dig[np.arange(lit.size), np.minimum(neg0.astype(np.int64) + 1, _LIT - 1)]
    plain = (ndig + neg0 == llen) & (ndig > 0) & ~((lead == ord("0")) & nxt_d & (ndig > 1))
    number = plain.copy()
    other = np.flatnonzero(~plain & (llen > 0))
    if other.size:
        mo = mat[other]
        state = np.zeros(other.size, np.int8)
        for k in range(_LIT):
            state = _T[state, _CLS[mo[:, k]]]
        number[other] = state == 9
    word = np.zeros(lit.size, bool)
    for w in (b"true", b"false", b"null"):
        wm = (llen == len(w))
        if wm.any():
            word |= wm & np.all(mat[:, : len(w)] == np.frombuffer(w, np.uint8), axis=1)
    bad[lline[~okl | ~(number | word)]] = True
    lit_key = kk[lit]
    lit_int = plain
    # string values of keys that must be numbers, literals of keys that must be strings -> json path
    numeric_key = (kk >= 1) & (kk != 2) & (kk <= 7)
    bad[s_line[keys[vstr & numeric_key]]] = True
    bad[s_line[keys[~vstr & ((kk == 0) | (kk == 2) | (kk == 9))]]] = True
    # ts and arrival_ns: integers only here (a float ts / arrival goes the json way); <= 18 digits
    numeric = np.isin(lit_key, [1, 3, 4, 5, 6, 7])
    bad[lline[numeric & ~number]] = True
    bad[lline[numeric & lit_int & (llen > 18)]] = True
    bad[lline[np.isin(lit_key, [1, 3, 4]) & ~lit_int]] = True
    ivals = _ints(mat, llen)
    fvals = np.zeros(lit.size)
    fl = np.flatnonzero(number & ~lit_int & np.isin(lit_key, [5, 6, 7]))
    if fl.size:
        fvals[fl] = np.char.decode(mat[fl].view(f"S{_LIT}").ravel(), "ascii").astype(np.float64)
    fvals = np.where(lit_int, ivals.astype(np.float64), fvals)

    def column(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        sel = lit_key == k
        has = np.zeros(m, bool)
        iv = np.zeros(m, np.int64)
        fv = np.zeros(m)
        isint = np.zeros(m, bool)
        ln = lline[sel]
        has[ln] = True
        iv[ln] = ivals[sel]
        fv[ln] = fvals[sel]
        isint[ln] = lit_int[sel]
        return has, iv, np.where(isint, iv.astype(np.float64), fv), isint

    _, ts, _, _ = column(1)
    _, arr, _, _ = column(3)
    has_s, samp, _, _ = column(4)
    has_sr, _, sr, _ = column(5)
    has_rh, _, rh, _ = column(6)
    has_d, _, dur_f, _ = column(7)
    bad |= arr < 0
    bad |= has_s & (samp < 0)
    # strings: source and unit
    sk = keys[vstr]
    sval = np.minimum(sk + 1, s_open.size - 1)
    src_name = np.full(m, -1, np.int64)
    unit_of = np.full(m, -1, np.int64)
    ulist: list[TimeUnit] = []
    for k, target in ((0, src_name), (2, unit_of)):
        sel = kid[sk] == k
        vi = sval[sel]
        ln = s_line[sk[sel]]
        vl = s_close[vi] - s_open[vi] - 1
        for length in np.unique(vl).tolist():
            if length <= 0:
                continue
            g = vl == length
            rows = np.ascontiguousarray(_gather(chunk, s_open[vi[g]] + 1, int(length)))
            uniq, inv = np.unique(rows.view(f"S{int(length)}").ravel(), return_inverse=True)
            for j, raw in enumerate(uniq.tolist()):
                rb = bytes(raw)
                if k == 0:
                    with _NAMES_LOCK:
                        code = names.setdefault(rb, len(names)) if rb else -1
                else:
                    if rb not in unit_cache:
                        try:
                            unit_cache[rb] = parse_unit(rb.decode("utf-8"))
                        except (TimeCoreError, UnicodeDecodeError):
                            unit_cache[rb] = None
                    un = unit_cache[rb]
                    if un is None:
                        code = -1
                    else:
                        ulist.append(un)
                        code = len(ulist) - 1
                target[ln[g][inv.ravel() == j]] = code
    bad |= (src_name < 0) | (unit_of < 0)
    # durations, as parse_event computes them
    tps = np.array([u.ticks_per_s for u in ulist] or [1], np.int64)[np.maximum(unit_of, 0)]
    is_si = np.array([u.is_sample_index for u in ulist] or [False])[np.maximum(unit_of, 0)]
    rate = np.where(has_sr, sr, np.where(has_rh, rh, np.where(is_si, tps.astype(np.float64), np.nan)))
    bad |= has_s & ~has_d & ~(rate > 0)
    bad |= has_d & ~(dur_f >= 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        dur = np.where(has_d, np.rint(dur_f), np.where(has_s, np.rint(samp * 1e9 / rate), 0.0))
    dur = np.where(np.isfinite(dur), dur, 0).astype(np.int64)
    # ts in ns of the source clock (exact integer conversion)
    whole, rest = np.divmod(ts, tps)
    start = np.where(tps == 1_000_000_000, ts, whole * 1_000_000_000 + (rest * 1_000_000_000 + tps // 2) // tps)
    ok = ~bad
    kind = np.where(bad, 2, 1).astype(np.int8)  # blank lines go the json way too (rare; it skips them)
    out.kind[a:b] = kind
    out.source[a:b] = src_name
    out.start_ns[a:b] = start
    out.end_ns[a:b] = start + dur
    out.arrival_ns[a:b] = arr
    close = np.zeros(m, np.int64)
    close[tline[last]] = tpos[last]
    out.close[a:b] = close + lo
    by_code = list(names)
    codes, first_at = np.unique(src_name[ok], return_index=True)
    for code, at in zip(codes.tolist(), first_at.tolist(), strict=True):
        sname = by_code[code].decode("utf-8")
        if sname not in out.units:
            out.units[sname] = ulist[int(unit_of[ok][at])].name


def render(data: bytes, sc: Scan, ref: np.ndarray, flag: np.ndarray, texts: dict[int, str]) -> bytes:
    """Output bytes: fast lines (kind 1) get `ref_ns` (and `ref_flag` 1 outlier / 2 duplicate)
    appended to their own text; lines in `texts` are written as given; other lines are left out.

    A join of byte slices: cheaper here than gathering every byte through an index array."""
    fmts = (b', "ref_ns": %d}\n', b', "ref_ns": %d, "ref_flag": "outlier"}\n',
            b', "ref_ns": %d, "ref_flag": "duplicate"}\n')
    parts: list[bytes] = []
    ap = parts.append
    rows = zip(sc.kind.tolist(), sc.starts.tolist(), sc.close.tolist(), ref.tolist(), flag.tolist(), strict=True)
    for i, (k, a, c, r, f) in enumerate(rows):
        if k == 1:
            ap(data[a:c])
            ap(fmts[f] % r)
        elif i in texts:
            ap(texts[i].encode("utf-8"))
    return b"".join(parts)
