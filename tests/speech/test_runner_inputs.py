"""`PassInputs.write` / `put_draft_frames` (vectorised, through `WhisperRunner._set_inputs`) write the same input table and
count the same draft statistics as the former per-row loops, pinned here as the reference: drafts
truncated to `max_draft`, ids >= end-of-text dropped with the rest closing up, frames cut to
`max_draft + 1`, for lists, tuples and numpy rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.speech.config import WhisperTokens
from tristream.speech.errors import AudioInputError
from tristream.speech.pass_io import COLS, SAMPLES_PER_POSITION
from tristream.speech.runner import WhisperRunner
from tristream.speech.whisper import Whisper

TOKENS = WhisperTokens.for_vocab(51865)
EOT = TOKENS.eot


def _former_set_inputs(r: WhisperRunner, lengths: list[int], bb: int, drafts: Sequence[Sequence[int]] | None,
                       slots: Sequence[int] | None, draft_frames: Sequence[Sequence[int]] | None
                       ) -> tuple[np.ndarray, int, int]:
    """The per-row loops before the vectorised rewrite: (table, truncated drafts, draft tokens)."""
    d = r.max_draft
    host = np.zeros_like(r.pass_in.host[:bb].numpy())
    truncated = tokens = 0
    host[:, 0] = 1
    host[:, 1:COLS] = 0
    host[:, COLS:] = EOT
    m = len(lengths)
    host[:m, 0] = np.maximum(1, -(-np.asarray(lengths, np.int64) // SAMPLES_PER_POSITION))
    host[:m, 2] = 1
    if slots is not None:
        host[:m, 3] = slots
    if drafts is not None:
        for i, dr in enumerate(drafts):
            if len(dr) > d:
                truncated += 1
            dr = [t for t in list(dr)[:d] if t < EOT]
            host[i, 1] = len(dr)
            host[i, COLS : COLS + len(dr)] = dr
            tokens += len(dr)
    if draft_frames is not None:
        lo, cap = COLS + d, d + 1
        for i, fr in enumerate(draft_frames):
            f = list(fr)[:cap]
            host[i, 4] = len(f)
            host[i, lo : lo + len(f)] = f
    return host, truncated, tokens


@pytest.fixture(scope="module")
def runner(tiny_whisper: Whisper) -> WhisperRunner:
    r = WhisperRunner(tiny_whisper, TOKENS, batch_buckets=(1, 2, 4, 8), audio_buckets_s=(2.0, 5.0), max_new_tokens=12,
                      chunk=4, early_stop=False, max_draft=10)
    r.device_times = True  # only a flag here: draft frames go into the table (no Triton needed on this path)
    return r


def _row(rng: np.random.Generator, n: int, hi: int, kind: int, special: float = 0.0) -> Sequence[int]:
    vals = rng.integers(0, hi, n)
    vals = np.where(rng.random(n) < special, rng.integers(EOT, EOT + 40, n), vals)  # EOT, timestamps...
    out = vals.tolist()
    return (out, tuple(out), np.asarray(out, np.int64))[kind]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6))
def test_set_inputs_equals_the_former_per_row_loops(runner: WhisperRunner, seed: int) -> None:
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 9))
    bb = runner.batch_bucket(m)
    lengths = rng.integers(0, 5 * 16000, m).tolist()
    slots = rng.permutation(16)[:m].tolist()
    kind = seed % 3
    drafts = None if seed % 7 == 0 else [
        _row(rng, int(rng.integers(0, 16)), EOT, kind, 0.3 if rng.random() < 0.4 else 0.0) for _ in range(m)]
    frames = None if seed % 5 == 0 else [_row(rng, int(rng.integers(0, 16)), 250, kind) for _ in range(m)]
    want, truncated, tokens = _former_set_inputs(runner, lengths, bb, drafts, slots, frames)
    before = (runner.stats.truncated_drafts, runner.stats.draft_tokens)
    runner._set_inputs(lengths, bb, drafts, slots, frames)
    np.testing.assert_array_equal(runner.pass_in.host[:bb].numpy(), want)
    np.testing.assert_array_equal(runner.pass_in.table[:bb].numpy(), want)
    assert (runner.stats.truncated_drafts - before[0], runner.stats.draft_tokens - before[1]) == (truncated, tokens)


def test_put_draft_frames_rows_and_errors(runner: WhisperRunner) -> None:
    tab = np.zeros((3, runner.pass_in.table.shape[1]), np.int64)
    runner.pass_in.put_draft_frames(tab, [2, 0], [[5, 6, 7], list(range(30))])
    lo = COLS + runner.max_draft
    assert tab[2, 4] == 3 and tab[2, lo : lo + 3].tolist() == [5, 6, 7] and not tab[2, lo + 3 :].any()
    assert tab[0, 4] == runner.max_draft + 1 and tab[0, lo:].tolist() == list(range(runner.max_draft + 1))
    assert not tab[1].any()
    with pytest.raises(AudioInputError, match="2 draft frame lists for 1 streams"):
        runner.pass_in.put_draft_frames(tab, [0], [[1], [2]])
    with pytest.raises(AudioInputError, match="1 drafts for 2 streams"):
        runner._set_inputs([16000, 16000], 2, [[1]])


def test_pass_refuses_mismatched_drafts_before_queueing_work(runner: WhisperRunner,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """run() checks one draft (and one frame list) per stream before the encode graph is queued
    (the encode now runs before the inputs are written): a bad call runs no graph."""
    ran: list[str] = []
    monkeypatch.setattr(runner, "_run", lambda kind, bb, ab: ran.append(kind))
    audio = [np.zeros(8000, np.float32), np.zeros(8000, np.float32)]
    with pytest.raises(AudioInputError, match="1 drafts for 2 streams"):
        runner.run(audio, drafts=[[1]])
    with pytest.raises(AudioInputError, match="3 draft frame lists for 2 streams"):
        runner.run(audio, drafts=[[1], [2]], draft_frames=[[0], [0], [0]])
    assert ran == []
