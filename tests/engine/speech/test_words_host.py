"""Host word building: `tokens_to_words` equals the former per-token loop (pinned here as the
reference), for random token pieces, frames and voiced masks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.engine.speech.commit import Word
from tristream.engine.speech.config import FRAME_S
from tristream.engine.speech.streaming import NS, tokens_to_words
from tristream.engine.speech.timing import snap_words

EOT = 50257
PIECES = {1: " a", 2: "b", 3: "", 4: " cd", 5: "'s", 6: " e", 7: "  ", 8: "f"}


def tokens_to_words_reference(token_ids: list[int], frames: list[int], text_of: Callable[[int], str], eot: int,
                              t0_ns: int, valid_frames: int, voiced: np.ndarray | None = None) -> list[Word]:
    """The implementation before the host-side rework of issue #4 (one branchy pass per token)."""
    texts: list[str] = []
    bounds: list[list[int]] = []
    last = 0
    end: int | None = None
    hi = max(valid_frames - 1, 0)
    for tid, fr in zip(token_ids, frames, strict=False):
        fr = min(max(int(fr), last), hi)
        if tid == eot:
            end = fr
            break
        last = fr
        piece = text_of(int(tid))
        if not piece:
            continue
        if texts and not piece[0].isspace():
            texts[-1] += piece
            continue
        if bounds:
            bounds[-1][1] = fr
        texts.append(piece)
        bounds.append([fr, fr])
    if bounds:
        a = bounds[-1][0]
        bounds[-1][1] = end if end is not None and end > a else min(last + 1, max(valid_frames, 1))
    spans = [(a, z) for a, z in bounds]
    if voiced is not None:
        spans = snap_words(spans, voiced[:valid_frames])
    return [Word(w, t0_ns + int(a * FRAME_S * NS), t0_ns + int(z * FRAME_S * NS)) for w, (a, z) in zip(texts, spans,
                                                                                                       strict=True)]


def random_case(seed: int) -> tuple[list[int], list[int], int, np.ndarray | None]:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    toks = rng.integers(1, 9, n).tolist()
    if n and seed % 3:
        toks[int(rng.integers(0, n))] = EOT
        if seed % 5 == 0:
            toks = [EOT] * (n // 3) + toks  # end of text first: no words
    frames = np.cumsum(rng.integers(-3, 12, max(0, len(toks) + int(rng.integers(-2, 2))))).tolist()  # may go back
    valid = int(rng.integers(0, 160))
    voiced = None if seed % 4 == 0 else rng.random(max(valid, 1) + int(rng.integers(0, 20))) > 0.3
    return toks, frames, valid, voiced


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 1_000_000), st.integers(0, 10**12))
def test_tokens_to_words_equals_the_former_loop(seed: int, t0: int) -> None:
    toks, frames, valid, voiced = random_case(seed)
    got = tokens_to_words(toks, frames, PIECES.__getitem__, EOT, t0, valid, voiced)
    want = tokens_to_words_reference(toks, frames, PIECES.__getitem__, EOT, t0, valid, voiced)
    assert got == want
    assert [w.text for w in got] == [w.text for w in want]
