"""Device DTW (Triton, one program per stream) against the host DTW it replaces: the same token
start frames. GPU, or CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tristream.speech import dtw_device
from tristream.speech.timing import anchored_token_starts, dtw_token_starts

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EOT = 50257


@pytest.fixture(autouse=True)
def _needs_triton() -> None:
    """Triton itself; the markers skip these tests without CUDA unless under TRITON_INTERPRET=1
    (tests/conftest.py)."""
    if not dtw_device.available():
        pytest.skip("needs Triton")


def _workspace(b: int, r: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(b, r, t, device=DEV), torch.zeros(b, r, t, device=DEV))


def _diagonal(rng: np.random.Generator, b: int, r: int, t: int, integer: bool) -> np.ndarray:
    """Alignment-like matrices: a noisy monotone ridge (small integers: sums exact in any order)."""
    m = np.zeros((b, r, t), np.float32)
    for i in range(b):
        edges = np.sort(rng.integers(0, t, r))
        for j in range(r):
            m[i, j, max(0, edges[j] - 2) : edges[j] + 3] += 3
    m += rng.integers(0, 3, m.shape) if integer else rng.standard_normal(m.shape).astype(np.float32)
    return m


@pytest.mark.parametrize("integer", [True, False])
def test_dtw_rows_equal_host_dtw(integer: bool) -> None:
    rng = np.random.default_rng(0 if integer else 1)
    b, r, t = 6, 9, 40
    mat = _diagonal(rng, b, r, t, integer)
    n_rows = np.array([9, 1, 5, 9, 3, 7])
    n_cols = np.array([40, 12, 1, 33, 40, 20])
    want = dtw_token_starts(mat, n_rows, n_cols)
    out = torch.zeros(b, r, dtype=torch.long, device=DEV)
    z = torch.zeros(b, dtype=torch.long, device=DEV)
    dtw_device.dtw_rows(torch.from_numpy(mat).to(DEV), z, z, torch.from_numpy(n_rows).to(DEV),
                        torch.from_numpy(n_cols).to(DEV), out, _workspace(b, r, t))
    got = out.cpu().numpy()
    for i in range(b):
        same = got[i, : n_rows[i]] == want[i, : n_rows[i]]
        if integer:  # exact sums: the same path, ties broken the same way
            assert same.all(), (i, got[i], want[i])
        else:  # float sums in another order may flip a near-tie; nearly all rows agree
            assert same.mean() >= 0.75, (i, got[i], want[i])


def test_anchored_starts_equal_host_anchoring() -> None:
    rng = np.random.default_rng(2)
    b, k, t = 5, 12, 60
    align = _diagonal(rng, b, k + 1, t, integer=True)
    toks = rng.integers(0, 50000, (b, k))
    toks[1, 7:] = EOT
    toks[3, 0] = EOT
    valid = np.array([60, 50, 41, 60, 7])
    accepted = np.array([10, 6, 0, 3, 9])
    dfr = [sorted(rng.integers(0, 55, 11).tolist()), sorted(rng.integers(0, 45, 8).tolist()), [],
           [5, 9], sorted(rng.integers(0, 30, 10).tolist())]
    want = anchored_token_starts(torch.from_numpy(align), toks, EOT, valid, accepted, dfr, retime=4)
    d = 11
    dtab = np.zeros((b, d), np.int64)
    for i, f in enumerate(dfr):
        dtab[i, : len(f)] = f
    out = torch.zeros(b, k + 1, dtype=torch.long, device=DEV)
    t_ = lambda x: torch.from_numpy(np.asarray(x, np.int64)).to(DEV)  # noqa: E731
    dtw_device.device_token_starts(torch.from_numpy(align).to(DEV), t_(toks), EOT, t_(valid), t_(accepted), t_(dtab),
                                   t_([len(f) for f in dfr]), 4, out, _workspace(b, k + 1, t))
    np.testing.assert_array_equal(out.cpu().numpy(), want)


def _agree(a: np.ndarray, b: np.ndarray) -> None:
    if DEV == "cpu":  # the interpreter's scans are numpy's: the same sums, the same path
        np.testing.assert_array_equal(a, b)
    else:
        assert a.shape == b.shape and (a == b).mean() >= 0.9, (a, b)


def _runner(model: torch.nn.Module, device_times: bool) -> object:
    from tristream.speech.config import WhisperTokens
    from tristream.speech.runner import WhisperRunner

    return WhisperRunner(model, WhisperTokens.for_vocab(51865), batch_buckets=(1, 2, 4), audio_buckets_s=(2.0, 5.0),
                         max_new_tokens=10, chunk=4, early_stop=False, max_draft=8, use_graphs=False,
                         device_times=device_times)


def test_runner_device_times_equal_host_times(make_whisper) -> None:  # type: ignore[no-untyped-def]
    """Whole passes (with and without drafts) and `align_rows` (moved to a smaller bucket, in place):
    the frames DTW'd in the align pass equal the host DTW's (on a GPU the prefix sums run in another
    order than numpy's, which may flip a near-tie of this random model: nearly all must agree)."""
    model = make_whisper().to(DEV, torch.float32)
    rng = np.random.default_rng(3)
    audio = [(0.1 * rng.standard_normal(int((1.2 + 0.7 * i) * 16000))).astype(np.float32) for i in range(4)]
    dev_r, host_r = _runner(model, True), _runner(model, False)
    a, b = dev_r.run(audio), host_r.run(audio)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(a.tokens, b.tokens)
    _agree(a.frames, b.frames)
    drafts = [row[:6].tolist() for row in b.tokens]
    dfr = [row[:7].tolist() for row in b.frames]
    a, b = dev_r.run(audio, drafts, dfr), host_r.run(audio, drafts, dfr)  # type: ignore[attr-defined]
    assert a.accepted.min() >= 6
    _agree(a.frames, b.frames)
    for rows in ([3, 1], [2, 0, 3]):
        for r in (dev_r, host_r):
            r.run(audio, drafts, dfr, word_times=False)  # type: ignore[attr-defined]
        fa, va = dev_r.align_rows(rows, [dfr[i] for i in rows])  # type: ignore[attr-defined]
        fb, vb = host_r.align_rows(rows, [dfr[i] for i in rows])  # type: ignore[attr-defined]
        _agree(fa, fb)
        np.testing.assert_array_equal(va, vb)


def test_median7_kernel_equals_the_network() -> None:
    """The one-kernel median filter selects exactly what `timing.median7` (and torch.median) does,
    ties included, over a width that is not a multiple of the block."""
    import torch.nn.functional as F

    from tristream.speech import median_device
    from tristream.speech.timing import median7

    g = torch.Generator().manual_seed(4)
    x = torch.randint(-3, 4, (6, 5, 300), generator=g).float() + torch.randn(6, 5, 300, generator=g).round(decimals=1)
    xp = F.pad(x, (3, 3), mode="reflect").to(DEV)
    got = median_device.median7_padded(xp)
    assert torch.equal(got.cpu(), median7([xp[..., i : i + 300] for i in range(7)]).cpu())
    assert torch.equal(got.cpu(), xp.cpu().unfold(-1, 7, 1).median(-1).values)
