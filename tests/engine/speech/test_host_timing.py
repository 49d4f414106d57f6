"""Host-side word timing: anchored DTW token starts equal a plain per-stream loop over whisper's DTW."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.engine.speech.timing import anchored_token_starts, dtw_reference


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

    from tristream.engine.speech.timing import median7

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

    from tristream.engine.speech.timing import alignment_matrix

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
