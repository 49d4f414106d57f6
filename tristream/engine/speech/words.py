"""Tokens → timed words on the reference clock, once per hypothesis or incrementally per stream.

`tokens_to_words` builds a hypothesis' words from scratch. `WordCache` gives the same words, but
re-does only those after the first token whose id or frame changed since the stream's previous
hypothesis: with drafts, an update re-decodes and re-times only the newest few tokens, so most
words (and their `Word` objects) carry over. A 16-stream update builds ~16 × 25 words; per-token
and per-word Python work was most of its host time.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tristream.engine.speech.commit import Word
from tristream.engine.speech.config import FRAME_S
from tristream.engine.speech.timing import snap_spans, voiced_bytes

NS = 1_000_000_000


def _group(ids: list[int], frames: list[int], text_of: Callable[[int], str], j0: int, stop: int, hi: int,
           last: int) -> tuple[list[str], list[int], list[int], int]:
    """Words of tokens `j0..stop-1` (token `j0` opens one): texts, opening token indices, start
    frames (running maximum of the frames from `last`, clamped to `hi`), and the last running value."""
    texts: list[str] = []
    opens: list[int] = []
    starts: list[int] = []
    for j in range(j0, stop):
        fr = frames[j]
        if fr > last:
            last = fr if fr < hi else hi
        piece = text_of(ids[j])
        if piece:
            if texts and not piece[0].isspace():
                texts[-1] += piece
            else:
                texts.append(piece)
                opens.append(j)
                starts.append(last)
    return texts, opens, starts, last


def _text_span(ids: list[int], frames: list[int], eot: int) -> tuple[int, int]:
    """(tokens paired with a frame, index of the end-of-text token among them or -1)."""
    n = min(len(ids), len(frames))
    try:
        return n, ids.index(eot, 0, n)
    except ValueError:
        return n, -1


def _last_end(frames: list[int], stop: int, last: int, a: int, hi: int, valid_frames: int) -> int:
    """End frame of the last word (starting at `a`): the end-of-text row's frame, else one after."""
    if stop >= 0:
        end = min(max(frames[stop], last), hi)
        if end > a:
            return end
    return min(last + 1, max(valid_frames, 1))


def _make(texts: list[str], spans: list[tuple[int, int]], t0_ns: int) -> list[Word]:
    return [Word(w, t0_ns + int(a * FRAME_S * NS), t0_ns + int(z * FRAME_S * NS))
            for w, (a, z) in zip(texts, spans, strict=True)]


def tokens_to_words(token_ids: list[int], frames: list[int], text_of: Callable[[int], str], eot: int,
                    t0_ns: int, valid_frames: int, voiced: np.ndarray | None = None) -> list[Word]:
    """Group tokens into words (a token starting with a space opens a word) timed by their frames.

    `frames[j]` is token j's start frame (DTW jump); a word ends where the next one starts, the last
    at the end-of-text token's frame when present (else one frame after its last token). Frames
    never go back and are clamped to the audio. With `voiced` (per-frame speech mask) the edges
    are snapped onto pauses (`timing.snap_words`).
    """
    n, stop = _text_span(token_ids, frames, eot)
    hi = max(valid_frames - 1, 0)
    texts, _, starts, last = _group(token_ids, frames, text_of, 0, stop if stop >= 0 else n, hi, 0)
    if not texts:
        return []
    spans = list(zip(starts, [*starts[1:], _last_end(frames, stop, last, starts[-1], hi, valid_frames)], strict=True))
    if voiced is not None:
        v = voiced[:valid_frames]
        if v.shape[0]:
            spans = snap_spans(spans, voiced_bytes(v), pos=spans[0][0] + 1)[0]
    return _make(texts, spans, t0_ns)


def _common(a: list[int], b: list[int], n: int) -> int:
    """Length of the common prefix of `a[:n]` and `b[:n]` (slice compares: C loops, no per-item Python)."""
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class WordCache:
    """One stream's last hypothesis words with what they were built from; `words()` equals
    `tokens_to_words` and rebuilds only the words after the first changed token.

    Word `w` (tokens `opens[w]..opens[w+1]-1`) keeps its text and unsnapped bounds while its tokens
    and the next word's first token have the same ids and frames, the buffer start is the same and
    its end frame is below the old clamp (the audio only grows between trims). Snapped, word `w`
    depends on the unsnapped bounds of words `0..w+1` and on the mask up to word `w+1`'s end, so one
    word less carries over, and the snapping resumes from the kept start of the first redone word.
    """

    __slots__ = ("ids", "frames", "t0_ns", "hi", "v", "texts", "opens", "starts", "mids", "words")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.frames: list[int] = []
        self.t0_ns = 0
        self.hi = -1
        self.v: bytes | None = None
        self.texts: list[str] = []
        self.opens: list[int] = []
        self.starts: list[int] = []  # unsnapped start frame per word
        self.mids: list[int] = []  # snapped start before the voiced trim (snap_spans' resume point)
        self.words: list[Word] = []

    def reset(self) -> None:
        self.hi, self.words = -1, []

    def _kept(self, ids: list[int], frames: list[int], n: int, stop: int, t0_ns: int, hi: int) -> int:
        """How many words keep their unsnapped bounds and text (0: rebuild all)."""
        if not self.words or t0_ns != self.t0_ns or hi < self.hi or len(self.opens) < 2:
            return 0
        old_ids = self.ids
        m = min(n if stop < 0 else stop, len(old_ids))  # old_ids: only the old text tokens
        p = min(_common(ids, old_ids, m), _common(frames, self.frames, m))
        opens, starts = self.opens, self.starts
        w = len(opens) - 1
        while w > 0 and (opens[w] >= p or (starts[w] >= self.hi and hi != self.hi)):
            w -= 1
        return w  # words 0..w-1 end at word w's start, which is unchanged

    def words_for(self, ids: list[int], frames: list[int], text_of: Callable[[int], str], eot: int, t0_ns: int,
                  valid_frames: int, voiced: np.ndarray | None = None) -> list[Word]:
        """`tokens_to_words(ids, frames, text_of, eot, t0_ns, valid_frames, voiced)`, reusing the
        previous call's words where they cannot differ. One cache per stream and per kind of call
        (with or without `voiced`); `text_of` must be the same function on every call."""
        n, stop = _text_span(ids, frames, eot)
        hi = max(valid_frames - 1, 0)
        v = None
        if voiced is not None:
            vm = voiced[:valid_frames]
            v = voiced_bytes(vm) if vm.shape[0] else b""
        keep = self._kept(ids, frames, n, stop, t0_ns, hi)
        if keep and ((v is None) != (self.v is None) or v == b""):
            keep = 0
        elif keep and v is not None:
            old = self.v
            e = self.starts[keep]  # end of word keep-1: the snapped bounds before it read the mask up to here
            if not old or e > len(v) or e > len(old) or v[:e] != old[:e]:
                keep = 0
            else:
                keep -= 1  # word keep-1's snapped end depends on word keep's unsnapped end: redo it
        end_text = stop if stop >= 0 else n
        if keep:
            j0 = self.opens[keep]
            last = min(max(max(frames[:j0]), 0), hi)  # running maximum of frames 0..j0-1, clamped
            texts, opens, starts, last = _group(ids, frames, text_of, j0, end_text, hi, last)
            texts = self.texts[:keep] + texts
            opens = self.opens[:keep] + opens
            starts = self.starts[:keep] + starts
        else:
            texts, opens, starts, last = _group(ids, frames, text_of, 0, end_text, hi, 0)
        self.ids, self.frames, self.t0_ns, self.hi, self.v = ids[:end_text], frames[:end_text], t0_ns, hi, v
        self.texts, self.opens, self.starts = texts, opens, starts
        if not texts:
            self.words, self.mids = [], []
            return []
        ends = [*starts[1:], _last_end(frames, stop, last, starts[-1], hi, valid_frames)]
        spans = list(zip(starts[keep:], ends[keep:], strict=True))
        if v:
            if keep:
                spans[0] = (self.mids[keep], spans[0][1])  # the boundary before it was moved already
            spans, mids = snap_spans(spans, v, pos=spans[0][0] + 1)
            self.mids = self.mids[:keep] + mids
        words = self.words[:keep] + _make(texts[keep:], spans, t0_ns)
        self.words = words
        return list(words)
