"""Draft (previous-hypothesis) decoding, per-sequence positions, alignment heads and DTW (CPU)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.speech._reference import TOKENS, dtw_reference, small_runner, tone
from tristream.speech.config import WhisperDims
from tristream.speech.runner import WhisperRunner
from tristream.speech.timing import alignment_matrix, dtw_token_starts
from tristream.speech.whisper import Whisper, load_whisper


def _audio(seconds: float, seed: int) -> np.ndarray:
    return tone(seconds, seed, 180, 40)


def _runner(model: Whisper, **kw: Any) -> WhisperRunner:
    return small_runner(model, **{"max_new_tokens": 12, "max_draft": 10, **kw})


def test_per_sequence_positions_equal_separate_decoding(tiny_whisper: Whisper) -> None:
    m = tiny_whisper
    enc = m.encode(torch.randn(2, 80, 100, generator=torch.Generator().manual_seed(0)))
    ids = torch.randint(0, 50000, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m.decode_full(ids, enc)
        cache = m.new_cache(2, enc.shape[1], 16)
        m.fill_cross(enc, cache)
        # row 0 prefilled 3 tokens, row 1 prefilled 6; then each steps at its own position
        m.decode(ids[:, :6], torch.arange(6), cache)
        got0, got1 = [], []
        for k in range(3):
            pos = torch.tensor([[3 + k], [6 + k]])
            tok = torch.stack([ids[0, 3 + k], ids[1, 6 + k]])[:, None]
            out = m.decode(tok, pos, cache)
            got0.append(out[0, 0])
            got1.append(out[1, 0])
    torch.testing.assert_close(torch.stack(got0), want[0, 3:6], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(got1), want[1, 6:9], rtol=1e-4, atol=1e-4)


def test_drafts_give_the_same_tokens_and_accept_the_agreeing_prefix(tiny_whisper: Whisper) -> None:
    r = _runner(tiny_whisper)
    audio = [_audio(1.5, 0), _audio(1.8, 1), _audio(0.9, 2)]
    plain = r.run(audio)
    assert plain.accepted.tolist() == [0, 0, 0] and plain.steps == 11  # the prefill gives the first of 12
    own = [row[:10].tolist() for row in plain.tokens]
    wrong = [list(own[0]), own[1][:4], [7, 8, 9]]
    wrong[0][5] = (wrong[0][5] + 1) % 50000
    for drafts, want_acc in ((own, [10, 10, 10]), (wrong, [5, 4, None])):
        res = r.run(audio, drafts)
        np.testing.assert_array_equal(res.tokens, plain.tokens)  # greedy output whatever the draft
        for got, want in zip(res.accepted.tolist(), want_acc, strict=True):
            if want is not None:
                assert got == want
    full = r.run(audio, own)
    assert full.steps == 1  # 10 accepted + 1 from the prefill: one step fills the 12th column (not a chunk of 4)
    assert r.stats.draft_accepted >= 30


def test_early_stop_with_fully_accepted_draft_needs_no_step() -> None:
    dims = WhisperDims(64, 1, 1, 4, 128, max_source_positions=250, max_target_positions=64)
    m = Whisper(dims).eval()
    with torch.no_grad():  # a decoder that always says end-of-text after token 3 → draft [3, 3, 3] stops at once
        m.tok.zero_()
        m.tok[TOKENS.eot, 0] = 1.0
        m.dec_ln.weight.fill_(0.0)
        m.dec_ln.bias.zero_()
        m.dec_ln.bias[0] = 1.0
    r = WhisperRunner(m, TOKENS, batch_buckets=(1,), audio_buckets_s=(2.0,), max_new_tokens=8, chunk=4,
                      early_stop=True, max_draft=4)
    res = r.run([_audio(1.0, 3)])
    assert res.tokens[0, 0] == TOKENS.eot and res.steps == 0


def test_alignment_logits_match_transformers_cross_attention() -> None:
    transformers = pytest.importorskip("transformers")
    dims = WhisperDims(64, 2, 3, 4, 128, max_source_positions=100, max_target_positions=64)
    cfg = transformers.WhisperConfig(**dims.to_hf(), attn_implementation="eager")
    ref = transformers.WhisperForConditionalGeneration(cfg).eval()
    ours = load_whisper(dims, ref.state_dict()).eval()
    ours.alignment_heads = ((1, 0), (1, 3), (2, 2))
    mel = torch.randn(2, 80, 200, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[*TOKENS.prompt(), 11, 400, 7000], [*TOKENS.prompt(), 12, 13, 14]])
    with torch.no_grad():
        r = ref(input_features=mel, decoder_input_ids=ids, output_attentions=True)
        enc = ours.encode(mel)
        cache = ours.new_cache(2, enc.shape[1], 16)
        ours.fill_cross(enc, cache)
        got = ours.alignment_logits(ids, cache).softmax(-1)
    want = torch.stack([r.cross_attentions[li][:, h] for li, h in ours.alignment_heads], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 30), st.integers(0, 10_000))
def test_vectorised_dtw_equals_whisper_loop(n: int, m: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    mat = rng.standard_normal((3, n, m))
    rows = rng.integers(1, n + 1, 3)
    frames = rng.integers(1, m + 1, 3)
    got = dtw_token_starts(mat, rows, frames)
    for b in range(3):
        assert got[b, : rows[b]].tolist() == dtw_reference(-mat[b, : rows[b], : frames[b]])
        assert (np.diff(got[b]) >= 0).all()


def test_alignment_matrix_finds_a_planted_diagonal() -> None:
    """Each token attends to its own stretch of frames; normalisation + DTW recover the stretches."""
    b, h, s, t = 1, 2, 5, 50
    logits = torch.full((b, h, s, t), -4.0)
    edges = [0, 8, 17, 30, 41, 50]
    for i in range(s):
        logits[0, :, i, edges[i] : edges[i + 1]] = 4.0
    mat = alignment_matrix(logits, torch.tensor([t]), torch.ones(b, s, dtype=torch.bool))
    starts = dtw_token_starts(mat.numpy(), np.array([s]), np.array([t]))
    assert np.abs(starts[0] - np.array(edges[:-1])).max() <= 2


def test_serial_steps_stop_at_the_last_usable_column(tiny_whisper: Whisper) -> None:
    """The last chunk is cut to the steps a row can still use, run as graphs of sizes summing to it."""
    r = _runner(tiny_whisper, chunk=6)
    assert r._step_sizes() == (6, 4, 2, 1)
    audio = [_audio(1.5, 0), _audio(1.1, 1)]
    plain = r.run(audio)
    assert plain.steps == 11  # 12 columns: 1 from the prefill, then 6 + 5
    res = r.run(audio, [row[:8].tolist() for row in plain.tokens])
    np.testing.assert_array_equal(res.tokens, plain.tokens)
    assert res.accepted.tolist() == [8, 8] and res.steps == 3  # columns 9..11
