"""Host-side word timing: anchored DTW and pause snapping equal plain reference loops; the median filter."""

from __future__ import annotations

import bisect
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.speech._reference import dtw_reference
from tristream.speech.timing import (
    anchored_token_starts,
    snap_spans,
    snap_words,
    voiced_bytes,
)


def snap_reference(bounds: list[tuple[int, int]], voiced: np.ndarray, window: int = 20, min_gap: int = 2
                   ) -> list[tuple[int, int]]:
    """The former implementation: every pause checked at every boundary, each word scanned by numpy."""
    t = voiced.shape[0]
    if not bounds or t == 0:
        return list(bounds)
    edges = np.flatnonzero(np.diff(np.concatenate([[1], voiced.astype(np.int8), [1]])))
    gaps = [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True) if b - a >= min_gap]
    out = [(int(a), int(b)) for a, b in bounds]
    for j in range(len(out) - 1):
        s0, b = out[j][0], out[j + 1][0]
        e1 = out[j + 1][1]
        best: tuple[int, int] | None = None
        for g0, g1 in gaps:
            if g0 < b + window and g1 > b - window and g0 > s0 and g1 < e1:
                if best is None or (g1 - g0, -abs((g0 + g1) // 2 - b)) > (best[1] - best[0], -abs(sum(best) // 2 - b)):
                    best = (g0, g1)
        if best is not None:
            out[j] = (out[j][0], best[0])
            out[j + 1] = (best[1], out[j + 1][1])
    for j, (a, z) in enumerate(out):
        seg = np.flatnonzero(voiced[max(a, 0) : min(z, t)])
        if seg.size:
            out[j] = (a + int(seg[0]), a + int(seg[-1]) + 1)
    return out


def speechlike(rng: np.random.Generator, t: int) -> np.ndarray:
    """Voiced runs with pauses of 1–15 frames (some shorter than min_gap)."""
    v = np.zeros(t, bool)
    f = int(rng.integers(0, 5))
    while f < t:
        w = int(rng.integers(1, 25))
        v[f : f + w] = True
        f += w + int(rng.integers(1, 15))
    return v


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 400), st.integers(0, 40), st.integers(0, 10_000))
def test_snap_words_equals_the_former_loop(t: int, n_words: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    voiced = speechlike(rng, t) if seed % 4 else rng.random(t) > 0.5
    cuts = np.sort(rng.integers(0, t + 3, n_words + 1))  # may run past the audio end
    bounds = [(int(a), int(max(b, a + 1 if seed % 3 else a))) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    for window in (20, 3):
        assert snap_words(bounds, voiced, window=window) == snap_reference(bounds, voiced, window=window)


def snap_spans_regex(out: list[tuple[int, int]], v: bytes, window: int = 20, min_gap: int = 2, pos: int = 0
                     ) -> tuple[list[tuple[int, int]], list[int]]:
    """Reference `snap_spans`: pauses by a regex scan, candidates by four bisections."""
    t = len(v)
    mids = [a for a, _ in out]
    if not out or t == 0:
        return out, mids
    if len(out) > 1:
        pat = re.compile(b"(?<!\\x00)\\x00{%d,}" % max(min_gap, 1))
        g0s: list[int] = []
        g1s: list[int] = []
        for m in pat.finditer(v, max(pos, 0)):
            a, b = m.span()
            g0s.append(a)
            g1s.append(b)
        for j in range(len(out) - 1 if g0s else 0):
            s0, b = out[j][0], out[j + 1][0]
            e1 = out[j + 1][1]
            lo = max(bisect.bisect_right(g0s, s0), bisect.bisect_right(g1s, b - window))
            hi = min(bisect.bisect_left(g0s, b + window), bisect.bisect_left(g1s, e1))
            best: tuple[int, int] | None = None
            for k in range(lo, hi):
                g0, g1 = g0s[k], g1s[k]
                if best is None or (g1 - g0, -abs((g0 + g1) // 2 - b)) > (best[1] - best[0], -abs(sum(best) // 2 - b)):
                    best = (g0, g1)
            if best is not None:
                out[j] = (out[j][0], best[0])
                out[j + 1] = (best[1], out[j + 1][1])
                mids[j + 1] = best[1]
    for j, (a, z) in enumerate(out):
        a0 = a if a > 0 else 0
        z0 = z if z < t else t
        if a0 < z0:
            f = v.find(1, a0, z0)
            if f >= 0:
                out[j] = (a + (f - a0), a + (v.rfind(1, a0, z0) + 1 - a0))
    return out, mids


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.integers(0, 25), st.integers(0, 10_000))
def test_snap_spans_equals_the_regex_version(t: int, n_words: int, seed: int) -> None:
    """Pauses found with `bytes.find` from any `pos` (inside a run, on its edge, past the end), any
    `min_gap` and window; spans and resume points equal the former regex scan's."""
    rng = np.random.default_rng(seed)
    voiced = speechlike(rng, t) if seed % 3 else rng.random(t) > 0.4
    v = voiced_bytes(voiced)
    cuts = np.sort(rng.integers(-2, t + 3, n_words + 1))
    bounds = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    if seed % 5 == 0 and len(bounds) > 2:  # unsorted bounds too
        bounds[1], bounds[2] = bounds[2], bounds[1]
    for window, min_gap in ((20, 2), (3, 1), (8, 3), (20, 0)):
        pos = int(rng.integers(-3, t + 4))
        assert snap_spans(list(bounds), v, window, min_gap, pos) == snap_spans_regex(list(bounds), v, window, min_gap, pos)


def anchored_reference(align: torch.Tensor, toks: np.ndarray, eot: int, valid: np.ndarray, accepted: np.ndarray,
                       draft_frames: list[list[int]] | None, retime: int) -> np.ndarray:
    """Per stream: keep the accepted draft's frames, whisper's plain DTW loop from the anchor on."""
    n_real, k = toks.shape
    out = np.zeros((n_real, k + 1), np.int64)
    for i in range(n_real):
        row = toks[i].tolist()
        n_text = row.index(eot) if eot in row else k
        v = min(int(valid[i]), align.shape[-1])
        r, f0 = 0, 0
        if draft_frames is not None:
            df = draft_frames[i]
            r = max(0, min(int(accepted[i]) - retime, len(df), n_text))
            if r > 0:
                f0 = min(max(int(df[r]) if r < len(df) else int(df[-1]), 0), v - 1)
                out[i, :r] = np.minimum(np.maximum.accumulate(np.asarray(df[:r], np.int64)), f0)
        block = align[i, r : n_text + 1, f0:v].numpy()
        starts = dtw_reference(-block)
        out[i, r : n_text + 1] = np.asarray(starts) + f0
        out[i, n_text + 1 :] = out[i, n_text]
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(2, 12), st.integers(4, 60), st.integers(0, 10_000), st.booleans())
def test_anchored_token_starts_equals_per_stream_loop(n: int, k: int, t: int, seed: int, drafts: bool) -> None:
    rng = np.random.default_rng(seed)
    eot = 99
    toks = rng.integers(0, 50, (n, k))
    for i in range(n):
        cut = int(rng.integers(0, k + 1))
        if cut < k:
            toks[i, cut:] = eot
    valid = rng.integers(1, t + 1, n)
    accepted = rng.integers(0, k + 1, n)
    dfr = [sorted(rng.integers(0, t, int(rng.integers(0, k + 2))).tolist()) for _ in range(n)] if drafts else None
    align = torch.randn(n + 2, k + 1, t)  # extra rows: bucket padding
    got = anchored_token_starts(align, toks, eot, valid, accepted, dfr, 3)
    want = anchored_reference(align, toks, eot, valid, accepted, dfr, 3)
    np.testing.assert_array_equal(got, want)


def test_median7_network_is_exact() -> None:
    """0-1 principle: a compare-exchange network selects the median of every input iff it does so
    for all 128 inputs of zeros and ones; then random inputs with ties against torch's median."""
    import itertools

    from tristream.speech.timing import median7

    for bits in itertools.product([0.0, 1.0], repeat=7):
        assert float(median7([torch.tensor([b]) for b in bits])) == sorted(bits)[3], bits
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (5, 9, 40), generator=g).float() + torch.randn(5, 9, 40, generator=g).round(decimals=1)
    want = x.unfold(-1, 7, 1).median(dim=-1).values
    got = median7([x[..., i : i + 34] for i in range(7)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_alignment_matrix_median_filter_unchanged(device: str) -> None:
    """On CUDA the filter is the median7 network, on a CPU unfold/median: both equal the original."""
    import torch.nn.functional as F

    from tristream.speech.timing import alignment_matrix

    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 4, 12, 60, generator=g) * 3).to(device)
    valid = torch.tensor([60, 41, 25], device=device)
    rows = torch.arange(12, device=device)[None, :] < torch.tensor([12, 9, 5], device=device)[:, None]
    got = alignment_matrix(logits, valid, rows)
    # the same normalisation with the unfold/median filter it replaced
    x = logits.float().masked_fill(~(torch.arange(60, device=device)[None, :] < valid[:, None])[:, None, None, :],
                                   float("-inf")).softmax(-1)
    r = rows[:, None, :, None].float()
    n = r.sum(2, keepdim=True).clamp_min(1.0)
    mean = (x * r).sum(2, keepdim=True) / n
    x = (x - mean) / ((((x - mean) * r) ** 2).sum(2, keepdim=True) / n).sqrt().clamp_min(1e-6)
    x = F.pad(x.reshape(12, 12, 60), (3, 3), mode="reflect").unfold(-1, 7, 1).median(-1).values.view(3, 4, 12, 60)
    assert torch.equal(got, x.mean(1))
