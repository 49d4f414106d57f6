"""Host word building: `tokens_to_words` equals the former per-token loop (pinned here as the
reference) for random token pieces, frames and voiced masks; `WordCache` (words carried over
between a stream's hypotheses) equals building every hypothesis afresh, alone and inside
`StreamingWhisper` (scripted streams, both align policies)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.speech.test_commit_alignment import MS, ScriptedRunner, _script
from tristream.speech.commit import Word
from tristream.speech.config import FRAME_S
from tristream.speech.streaming import NS, StreamingWhisper, tokens_to_words
from tristream.speech.timing import snap_words
from tristream.speech.words import WordCache

EOT = 50257
PIECES = {1: " a", 2: "b", 3: "", 4: " cd", 5: "'s", 6: " e", 7: "  ", 8: "f"}


def tokens_to_words_reference(token_ids: list[int], frames: list[int], text_of: Callable[[int], str], eot: int,
                              t0_ns: int, valid_frames: int, voiced: np.ndarray | None = None) -> list[Word]:
    """The reference implementation: one branchy pass per token (the vectorised code must equal it)."""
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


def evolve(rng: np.random.Generator, toks: list[int], frames: list[int], valid: int, voiced: np.ndarray,
           t0: int) -> tuple[list[int], list[int], int, np.ndarray, int]:
    """The next hypothesis of a stream: mostly the same prefix with a re-decoded, re-timed tail;
    sometimes more audio, a changed mask, a moved buffer start or a whole new hypothesis."""
    n_text = toks.index(EOT) if EOT in toks else len(toks)
    keep = int(rng.integers(0, n_text + 1)) if rng.random() < 0.3 else max(0, n_text - int(rng.integers(0, 6)))
    tail = rng.integers(1, 9, int(rng.integers(0, 8))).tolist()
    new = toks[:keep] + tail + ([EOT] if rng.random() < 0.7 else [])
    fr = frames[:keep]
    if fr and rng.random() < 0.2:
        fr[int(rng.integers(0, len(fr)))] += int(rng.integers(-2, 3))  # an older token re-timed
    base = fr[-1] if fr else 0
    fr = fr + np.cumsum(rng.integers(-1, 10, len(new) - keep + 1)).tolist()
    fr[keep:] = [base + f for f in fr[keep:]]
    if rng.random() < 0.7:
        valid += int(rng.integers(0, 30))
    elif rng.random() < 0.3:
        valid = max(0, valid - int(rng.integers(0, 30)))
    grown = rng.random(max(valid, 1) + 5) > 0.25
    grown[: min(len(voiced), len(grown))] = voiced[: len(grown)]
    if rng.random() < 0.15:
        grown[int(rng.integers(0, len(grown)))] ^= True  # the loudest frame moved: the mask changes
    if rng.random() < 0.05:
        t0 += 7
    if rng.random() < 0.05:
        new, fr = random_case(int(rng.integers(0, 10**6)))[:2]
    return new, fr, valid, grown, t0


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 1_000_000))
def test_word_cache_equals_building_every_hypothesis_afresh(seed: int) -> None:
    rng = np.random.default_rng(seed)
    toks, frames, valid, voiced = random_case(seed)
    voiced = rng.random(max(valid, 1) + 5) > 0.25 if voiced is None else voiced
    t0 = int(rng.integers(0, 10**12))
    snapped, plain = WordCache(), WordCache()
    for _ in range(30):
        want = tokens_to_words(toks, frames, PIECES.__getitem__, EOT, t0, valid, voiced)
        assert snapped.words_for(toks, frames, PIECES.__getitem__, EOT, t0, valid, voiced) == want
        assert plain.words_for(toks, frames, PIECES.__getitem__, EOT, t0, valid) == \
            tokens_to_words(toks, frames, PIECES.__getitem__, EOT, t0, valid)
        toks, frames, valid, voiced, t0 = evolve(rng, toks, frames, valid, voiced, t0)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 1_000_000))
def test_word_cache_with_redecoded_tokens_equals_afresh(seed: int) -> None:
    """The newest words re-decoded with their frames kept (the id of a token changes, often one
    that opens a word, into a piece that opens one, continues one or is empty), more audio and
    tokens appended: the cache keeps the word before the change only where that is exact."""
    rng = np.random.default_rng(seed)
    toks, frames, valid, voiced = random_case(seed)
    voiced = rng.random(max(valid, 1) + 5) > 0.25 if voiced is None else voiced
    t0 = int(rng.integers(0, 10**12))
    snapped, plain = WordCache(), WordCache()
    hits = 0
    for _ in range(30):
        want = tokens_to_words(toks, frames, PIECES.__getitem__, EOT, t0, valid, voiced)
        got = snapped.words_for(toks, frames, PIECES.__getitem__, EOT, t0, valid, voiced)
        assert got == want and [w.text for w in got] == [w.text for w in want]
        assert plain.words_for(toks, frames, PIECES.__getitem__, EOT, t0, valid) == \
            tokens_to_words(toks, frames, PIECES.__getitem__, EOT, t0, valid)
        n_text = toks.index(EOT) if EOT in toks else len(toks)
        toks = toks[:n_text]
        if toks and rng.random() < 0.8:  # re-decode one of the last tokens, same frame
            j = len(toks) - 1 - int(rng.integers(0, min(3, len(toks))))
            toks[j] = int(rng.integers(1, 9))
            hits += 1
        extra = int(rng.integers(0, 3))
        toks = toks + rng.integers(1, 9, extra).tolist() + ([EOT] if rng.random() < 0.8 else [])
        last = frames[len(frames) - 1] if frames else 0
        frames = frames[:n_text] + [last + int(f) for f in np.cumsum(rng.integers(0, 6, len(toks) - n_text + 1))]
        if rng.random() < 0.6:
            valid += int(rng.integers(0, 12))
            grown = rng.random(max(valid, 1) + 5) > 0.25
            grown[: min(len(voiced), len(grown))] = voiced[: len(grown)]
            voiced = grown
    assert hits


class _VoicedRunner(ScriptedRunner):
    """`ScriptedRunner` whose voiced masks follow the script (pauses between words), so that the
    word edges are snapped, and whose frames of older tokens are sometimes re-timed."""

    def _mask(self, rows: int, slots: list[int]) -> np.ndarray:
        assert self.asr is not None
        out = np.zeros((rows, 300), bool)
        for r, slot in enumerate(slots):
            sid, s = next((k, v) for k, v in self.asr.streams.items() if v.slot == slot)
            for a, b in self.words[sid]:
                lo, hi = max(0, (a - s.t0_ns) // (20 * MS)), max(0, (b - s.t0_ns) // (20 * MS))
                out[r, lo:hi] = True
        return out

    def run_store(self, store: object, slots: list[int], drafts: object = None, draft_frames: object = None,
                  word_times: bool | None = None):  # type: ignore[no-untyped-def]
        res = super().run_store(store, slots, drafts, draft_frames, word_times)
        self.slots = slots
        if self.calls % 5 == 0:  # an older token re-timed by a frame
            res.frames[:, 1] += 1
        if res.voiced is not None:
            res.voiced = self._mask(len(slots), slots)
        return res

    def align_rows(self, rows: list[int], draft_frames: object = None) -> tuple[np.ndarray, np.ndarray]:
        frames, _ = super().align_rows(rows, draft_frames)
        return frames, self._mask(len(rows), [self.slots[r] for r in rows])


def _events(align: str) -> list[tuple[str, list[Word], list[Word]]]:
    starts = {f"s{i}": (3 + i) * NS for i in range(3)}
    script = {sid: [(t0 + a, t0 + b) for a, b in _script(i, 14.0)] for i, (sid, t0) in enumerate(starts.items())}
    r = _VoicedRunner(script)
    asr = StreamingWhisper(r, lambda t: f" w{t}" if t % 3 else f"x{t}", min_update_s=0.5, trim_after_s=4.0,  # type: ignore[arg-type]
                           keep_s=1.0, align=align)
    r.asr = asr
    for sid, t0 in starts.items():
        asr.open(sid, t0)
    out = []
    silence = np.zeros(8000, np.float32)
    for k in range(0, 14 * 16000, 8000):
        for sid in starts:
            asr.push(sid, silence, starts[sid] + k * NS // 16000)
        out += [(e.stream_id, e.committed, e.partial) for e in asr.step()]
    out += [(sid, (e := asr.close(sid)).committed, e.partial) for sid in starts]
    return out


@pytest.mark.parametrize("align", ["every", "commit"])
def test_streaming_with_word_caches_equals_building_words_afresh(align: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cached = _events(align)
    monkeypatch.setattr(WordCache, "words_for", lambda self, *a: tokens_to_words(*a))
    afresh = _events(align)
    assert len(cached) == len(afresh) > 80
    assert sum(len(c) for _, c, _ in cached) > 40  # words were committed, across buffer trims
    for (sa, ca, pa), (sb, cb, pb) in zip(cached, afresh, strict=True):
        assert sa == sb and ca == cb and pa == pb
        assert [w.text for w in ca + pa] == [w.text for w in cb + pb]
