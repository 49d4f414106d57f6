"""Word times from cross-attention: alignment heads → normalised matrix → DTW (whisper's word_timestamps).

`alignment_matrix` runs on the device inside the runner's graphed pass: softmax of the alignment
heads' cross-attention over each stream's real audio frames, z-scored along the tokens,
median-filtered along time, averaged over heads. `dtw_token_starts` then finds, per stream, the
monotonic token-to-frame path of least cost through the negated matrix (dynamic time warping) and
returns the frame where each token's row is entered: OpenAI's "jump times". A word starts at its
first token's jump and ends at the next word's (the last word at the end-of-text row's);
`snap_words` then moves those edges onto nearby pauses, since DTW counts a pause into a word.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tristream.speech import median_device


def alignment_matrix(logits: torch.Tensor, valid_frames: torch.Tensor, valid_rows: torch.Tensor,
                     medfilt: int = 7) -> torch.Tensor:
    """`[B, heads, S, T]` scaled cross-attention logits → `[B, S, T]` alignment matrix.

    `valid_frames` `[B]`: encoder frames holding audio (the rest is bucket padding, masked before
    the softmax); `valid_rows` `[B, S]` bool: token rows that take part in the normalisation.
    """
    b, h, s, t = logits.shape
    frame_ok = torch.arange(t, device=logits.device)[None, :] < valid_frames[:, None]  # [B, T]
    x = logits.float().masked_fill(~frame_ok[:, None, None, :], float("-inf")).softmax(dim=-1)
    rows = valid_rows[:, None, :, None].to(x.dtype)  # [B, 1, S, 1]
    n = rows.sum(dim=2, keepdim=True).clamp_min(1.0)
    mean = (x * rows).sum(dim=2, keepdim=True) / n
    var = (((x - mean) * rows) ** 2).sum(dim=2, keepdim=True) / n
    x = (x - mean) / var.sqrt().clamp_min(1e-6)
    if medfilt > 1:
        pad = medfilt // 2
        xp = F.pad(x.reshape(b * h, s, t), (pad, pad), mode="reflect")
        if medfilt == 7 and xp.is_cuda and median_device.available():  # one kernel for the whole network
            x = median_device.median7_padded(xp)
        elif medfilt == 7 and xp.is_cuda:  # on a CPU the unfold/median is as fast and allocates less
            x = median7([xp[..., i : i + t] for i in range(7)])
        else:
            x = xp.unfold(-1, medfilt, 1).median(dim=-1).values
        x = x.view(b, h, s, t)
    return x.mean(dim=1)


# Devillard's median-of-7 selection network: 13 compare-exchanges; afterwards slot 3 holds the median
_MEDIAN7 = ((0, 5), (0, 3), (1, 6), (2, 4), (0, 1), (3, 5), (2, 6), (2, 3), (3, 6), (4, 5), (1, 4), (1, 3), (3, 4))


def median7(v: list[torch.Tensor]) -> torch.Tensor:
    """Elementwise median of 7 same-shaped tensors by a compare-exchange network (min/max only, so
    the result is exactly one of the inputs, as `torch.median` returns). On a GPU this replaces
    `unfold(...).median()`, whose gather-median kernel took 1.9 of the 5.3 ms of kernel time of a
    16-stream Whisper-tiny update (bench/results/encoders_whisper.json at 938d43a, kernel profile); on a CPU
    its 26 temporaries make it no faster, so `alignment_matrix` keeps unfold/median there."""
    if len(v) != 7:
        raise ValueError(f"median7 takes 7 tensors, got {len(v)}")
    p = list(v)
    for i, j in _MEDIAN7:
        p[i], p[j] = torch.minimum(p[i], p[j]), torch.maximum(p[i], p[j])
    return p[3]


def dtw_token_starts(matrix: np.ndarray, n_rows: np.ndarray, n_frames: np.ndarray) -> np.ndarray:
    """Per stream, the frame where the least-cost monotonic path through `-matrix` enters each row.

    `matrix` `[B, N, M]` (higher = more attention); stream `b` uses its first `n_rows[b]` rows and
    `n_frames[b]` frames; the path runs from `(0, 0)` to `(n_rows-1, n_frames-1)` with diagonal,
    down and right moves (whisper's `dtw`). Returns `[B, N]` int frames (rows past `n_rows` repeat
    the last). Vectorised over streams and frames: one pass per row (a prefix minimum), then a backtrace that
    looks up one prefix argmin per row.
    """
    b, n, m = matrix.shape
    # layout [row, frame, stream]: the prefix scans along frames run over contiguous stream vectors
    cost = np.ascontiguousarray(-np.asarray(matrix, dtype=np.float32).transpose(1, 2, 0))
    acc = np.empty((n, m, b), np.float32)  # least cost of a path ending at (row, frame)
    gap = np.empty((n, m, b), np.float32)  # arrive_k - cost[row, :k]: its prefix argmin is the entry frame
    csum = np.cumsum(cost, axis=1)
    acc[0] = csum[0]
    arrive = np.empty((m, b), np.float32)
    for i in range(1, n):
        prev = acc[i - 1]
        arrive[0] = prev[0]
        np.minimum(prev[:-1], prev[1:], out=arrive[1:])
        e = gap[i]
        np.subtract(arrive, csum[i], out=e)
        e += cost[i]
        np.add(csum[i], np.minimum.accumulate(e, axis=0), out=acc[i])
    # backtrace, all streams at once: per row, the last prefix argmin of `gap` up to each stream's
    # current frame (frames past it masked), only for streams that have that row
    rows = np.maximum(1, np.asarray(n_rows, dtype=np.int64))
    j = np.maximum(1, np.minimum(np.asarray(n_frames, dtype=np.int64), m)) - 1  # current frame per stream
    starts = np.zeros((b, n), dtype=np.int64)
    col = np.arange(b)
    rev = np.arange(m)[::-1, None]  # reversed frame index: the last minimum is the first in reverse
    for i in range(int(rows.max()) - 1, 0, -1):
        live = rows > i
        seg = np.where(rev <= j[None, :], gap[i, ::-1], np.inf)  # [m, b], frame m-1-r at row r
        c = (m - 1) - np.argmin(seg, axis=0)  # last minimum: prefer entering late (diagonal/down before right)
        diag = (c > 0) & (acc[i - 1, np.maximum(c - 1, 0), col] <= acc[i - 1, c, col])
        starts[:, i] = np.where(live, c, 0)
        j = np.where(live, np.where(diag, c - 1, c), j)
    fill = np.arange(n)[None, :] >= rows[:, None]
    last = starts[col, rows - 1]
    starts[fill] = np.broadcast_to(last[:, None], (b, n))[fill]
    return starts


def anchored_token_starts(align: torch.Tensor, toks: np.ndarray, eot: int, valid: np.ndarray, accepted: np.ndarray,
                          draft_frames: Sequence[Sequence[int]] | None, retime: int) -> np.ndarray:
    """Start frame of every token (and of the end-of-text row) by DTW over the device matrix `align`
    `[B, K + 1, T]` (rows of streams `0..len(toks)-1`); `toks` `[n, K]`, `valid` `[n]` audio frames.

    With `draft_frames` (the previous pass's frames of the draft tokens, same buffer start), the
    accepted draft keeps its times except its last `retime` tokens, and DTW runs from there: rows
    `r0..n_text`, frames `f0..valid`, anchored at the re-timed token's old start. Only the rows and
    frames in play leave the device (one copy).
    """
    n_real, k = toks.shape
    is_eot = toks == eot
    n_text = np.where(is_eot.any(1), is_eot.argmax(1), k)
    valid = np.minimum(valid, align.shape[-1])
    r0 = np.zeros(n_real, np.int64)
    f0 = np.zeros(n_real, np.int64)
    frames = np.zeros((n_real, k + 1), np.int64)
    if draft_frames is not None:
        for i, df in enumerate(draft_frames):
            r = max(0, min(int(accepted[i]) - retime, len(df), int(n_text[i])))
            if r > 0:
                r0[i], f0[i] = r, min(max(int(df[r]) if r < len(df) else int(df[-1]), 0), int(valid[i]) - 1)
                frames[i, :r] = np.minimum(np.maximum.accumulate(np.asarray(df[:r], np.int64)), f0[i])
    lo_r, hi_r = int(r0.min()), int(n_text.max()) + 1
    lo_f, hi_f = int(f0.min()), int(valid.max())
    block = align[:n_real, lo_r:hi_r, lo_f:hi_f].cpu().numpy()
    rows = n_text + 1 - r0
    cols = valid - f0
    sub = np.zeros((n_real, int(rows.max()), int(cols.max())), np.float32)
    for i in range(n_real):
        sub[i, : rows[i], : cols[i]] = block[i, r0[i] - lo_r : n_text[i] + 1 - lo_r, f0[i] - lo_f : valid[i] - lo_f]
    starts = dtw_token_starts(sub, rows, cols)
    for i in range(n_real):
        frames[i, r0[i] : n_text[i] + 1] = starts[i, : rows[i]] + f0[i]
        frames[i, n_text[i] + 1 :] = frames[i, n_text[i]]
    return frames


def _pauses(v: bytes, pos: int, min_gap: int) -> tuple[list[int], list[int]]:
    """Starts and ends of the maximal runs of at least `min_gap` zero bytes in the 0/1 mask `v` that
    start at or after `pos` (a run begun before `pos` is none of them): the matches of the regex
    `(?<!\\x00)\\x00{min_gap,}` from `pos`, found with `bytes.find` (no match objects: about half the
    time for the few pauses after a stream's redone words)."""
    g0s: list[int] = []
    g1s: list[int] = []
    i = pos if pos > 0 else 0
    find = v.find
    if 0 < i < len(v) and v[i - 1] == 0 and v[i] == 0:  # inside a run that began before pos
        i = find(1, i)
        if i < 0:
            return g0s, g1s
    gap = max(min_gap, 1)
    zeros = b"\x00" * gap
    while True:  # v[i - 1] is never 0 here, so a run found at or after i is maximal
        a = find(zeros, i)
        if a < 0:
            return g0s, g1s
        i = find(1, a + gap)
        g0s.append(a)
        if i < 0:
            g1s.append(len(v))
            return g0s, g1s
        g1s.append(i)


def voiced_bytes(voiced: np.ndarray) -> bytes:
    """A voiced mask as one byte (0 or 1) per frame, the form `snap_spans` reads."""
    if voiced.dtype != np.bool_:
        voiced = voiced.astype(np.int8) != 0
    return voiced.tobytes()


SNAP_WINDOW = 20  # frames around a word boundary searched for a pause
SNAP_MIN_GAP = 2  # unvoiced frames that make a pause


def snap_words(bounds: list[tuple[int, int]], voiced: np.ndarray, window: int = SNAP_WINDOW,
               min_gap: int = SNAP_MIN_GAP) -> list[tuple[int, int]]:
    """Move DTW word edges onto pauses: `bounds` `(start, end)` frames per word, `voiced` `[T]` bool.

    DTW hands every frame to some token, so a pause is counted inside the next word (or the last
    one). For each boundary between consecutive words, the longest unvoiced run (≥ `min_gap`
    frames) within `window` frames of it that lies inside the two words becomes the pause: the
    first word ends where it starts, the second starts where it ends. Then each word is trimmed to
    its first and last voiced frame. Words without a voiced frame keep their bounds.

    Plain Python over the mask's bytes: a few dozen words and pauses per stream, where numpy's
    per-call cost dominates. Pauses come from one scan (runs of ≥ `min_gap` zero bytes, `bytes.find`),
    are sorted and disjoint, so each boundary bisects to its candidates; a word's first and last
    voiced frames are `bytes.find`/`rfind`.
    """
    if not bounds or voiced.shape[0] == 0:
        return list(bounds)
    return snap_spans([(int(a), int(b)) for a, b in bounds], voiced_bytes(voiced), window, min_gap)[0]


def snap_spans(out: list[tuple[int, int]], v: bytes, window: int = SNAP_WINDOW, min_gap: int = SNAP_MIN_GAP,
               pos: int = 0) -> tuple[list[tuple[int, int]], list[int]]:
    """`snap_words` on int bounds (changed in place and returned) over a `voiced_bytes` mask; also
    returns each word's start after the boundary before it was moved, before the voiced trim (what
    a later call needs to resume from that word: see `words.WordCache`).

    `pos`: pauses starting at or before `pos - 1` are ignored, which changes nothing when no
    boundary's left word starts before `pos - 1` (true for `pos = bounds[0][0] + 1` when the bounds
    are sorted and contiguous, as `tokens_to_words` makes them)."""
    t = len(v)
    mids = [a for a, _ in out]
    if not out or t == 0:
        return out, mids
    if len(out) > 1:
        g0s, g1s = _pauses(v, pos, min_gap)
        n_gaps = len(g0s)
        for j in range(len(out) - 1 if n_gaps else 0):  # no pause anywhere: no boundary moves
            s0 = out[j][0]
            b, e1 = out[j + 1]
            # candidates: g0 > s0, g1 > b - window, g0 < b + window, g1 < e1; both edges increase with
            # the index, so they run from the larger of two bisections until one upper bound fails
            k = bisect_right(g0s, s0)
            k1 = bisect_right(g1s, b - window)
            if k1 > k:
                k = k1
            lim = b + window
            best = -1
            best_len = best_off = 0
            while k < n_gaps and g0s[k] < lim and g1s[k] < e1:
                g0, g1 = g0s[k], g1s[k]
                size, off = g1 - g0, abs((g0 + g1) // 2 - b)
                if best < 0 or size > best_len or (size == best_len and off < best_off):  # longest, then nearest
                    best, best_len, best_off = k, size, off
                k += 1
            if best >= 0:
                out[j] = (s0, g0s[best])
                out[j + 1] = (g1s[best], e1)
                mids[j + 1] = g1s[best]
    for j, (a, z) in enumerate(out):
        a0 = a if a > 0 else 0
        z0 = z if z < t else t
        if a0 < z0:  # first and last voiced frame (mostly the word's own edges: index before searching)
            f = a0 if v[a0] == 1 else v.find(1, a0, z0)
            if f >= 0:
                out[j] = (a + (f - a0), a + ((z0 if v[z0 - 1] == 1 else v.rfind(1, a0, z0) + 1) - a0))
    return out, mids
