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

from tristream.speech.commit import Word, common_prefix
from tristream.speech.config import FRAME_S
from tristream.speech.timing import SNAP_MIN_GAP, SNAP_WINDOW, snap_spans, voiced_bytes

NS = 1_000_000_000


def _group(ids: list[int], frames: list[int], text_of: Callable[[int], str], j0: int, stop: int, hi: int,
           last: int, texts: list[str], opens: list[int], starts: list[int]) -> int:
    """Words of tokens `j0..stop-1` (token `j0` opens one) appended to `texts`, `opens` (opening token
    indices) and `starts` (start frames: running maximum of the frames from `last`, clamped to `hi`);
    returns the last running value."""
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
    return last


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


_NS_AT = [int(a * FRAME_S * NS) for a in range(3001)]  # frame -> ns offset, up to 60 s (Whisper buffers: 30)


def _make(texts: list[str], spans: list[tuple[int, int]], t0_ns: int, old: list[Word] | None = None) -> list[Word]:
    """Words from texts and frame spans. Frame a is `int(a * FRAME_S * NS)` ns after the buffer start,
    exactly that float expression (not a * 20_000_000: the rounding differs), read from a table.
    `old[i]` (the word a cache had at that place) is reused when equal: a redone word mostly is."""
    at, n, fs, ns = _NS_AT, len(_NS_AT), FRAME_S, NS
    out: list[Word] = []
    was = old if old is not None else []
    m = len(was)
    for i, (w, (a, z)) in enumerate(zip(texts, spans)):  # noqa: B905 (same length: one span per word)
        a_ns = t0_ns + (at[a] if 0 <= a < n else int(a * fs * ns))
        z_ns = t0_ns + (at[z] if 0 <= z < n else int(z * fs * ns))
        if i < m:
            o = was[i]
            if o.start_ns == a_ns and o.end_ns == z_ns and o.text == w:
                out.append(o)
                continue
        out.append(Word(w, a_ns, z_ns))
    return out


def tokens_to_words(token_ids: list[int], frames: list[int], text_of: Callable[[int], str], eot: int,
                    t0_ns: int, valid_frames: int, voiced: np.ndarray | bytes | None = None) -> list[Word]:
    """Group tokens into words (a token starting with a space opens a word) timed by their frames.

    `frames[j]` is token j's start frame (DTW jump); a word ends where the next one starts, the last
    at the end-of-text token's frame when present (else one frame after its last token). Frames
    never go back and are clamped to the audio. With `voiced` (per-frame speech mask) the edges
    are snapped onto pauses (`timing.snap_words`); `voiced` may also be its `timing.voiced_bytes`.
    """
    n, stop = _text_span(token_ids, frames, eot)
    hi = max(valid_frames - 1, 0)
    texts: list[str] = []
    starts: list[int] = []
    last = _group(token_ids, frames, text_of, 0, stop if stop >= 0 else n, hi, 0, texts, [], starts)
    if not texts:
        return []
    spans = list(zip(starts, [*starts[1:], _last_end(frames, stop, last, starts[-1], hi, valid_frames)], strict=True))
    if voiced is not None:
        v = voiced[:valid_frames]
        if len(v):
            spans = snap_spans(spans, v if isinstance(v, bytes) else voiced_bytes(v), pos=spans[0][0] + 1)[0]
    return _make(texts, spans, t0_ns)


class WordCache:
    """One stream's last hypothesis words with what they were built from; `words()` equals
    `tokens_to_words` and rebuilds only the words after the first changed token.

    Word `w` (tokens `opens[w]..opens[w+1]-1`) keeps its text and unsnapped bounds while its tokens
    have the same ids and frames, the next word's first token the same frame and an id that still
    opens a word (mostly the same id; a re-decoded newest word changes it), the buffer start is the
    same and its end frame is below the old clamp (the audio only grows between trims). Snapped,
    word `w` depends on the unsnapped bounds of words `0..w+1` and on the mask up to word `w+1`'s
    end, so one word less carries over, and the snapping resumes from the kept start of the first
    redone word. A redone word equal to the one it replaces is that same object.
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

    def _kept(self, ids: list[int], frames: list[int], end_text: int, hi: int, text_of: Callable[[int], str]) -> int:
        """How many words keep their unsnapped bounds and text (0: rebuild all); the caller has
        checked that there are old words, the buffer start is the same and the clamp did not drop."""
        old_ids, old_frames = self.ids, self.frames
        m = min(end_text, len(old_ids))  # old_ids: only the old text tokens
        p = common_prefix(ids, old_ids, m)
        if p:
            p = common_prefix(frames, old_frames, p)
        opens = self.opens
        w = len(opens) - 1
        while w > 0 and opens[w] >= p:
            w -= 1
        # the first change is only the id of a token that opened a word (the newest word re-decoded):
        # the word before it keeps its text and its end (the changed token's frame) when the new
        # token opens a word too
        if w + 1 < len(opens) and opens[w + 1] == p < m and frames[p] == old_frames[p]:
            piece = text_of(ids[p])
            if piece and piece[0].isspace():
                w += 1
        if hi != self.hi:
            starts, old_hi = self.starts, self.hi
            while w > 0 and starts[w] >= old_hi:
                w -= 1
        return w  # words 0..w-1 end at word w's start, which is unchanged

    def words_for(self, ids: list[int], frames: list[int], text_of: Callable[[int], str], eot: int, t0_ns: int,
                  valid_frames: int, voiced: np.ndarray | bytes | None = None) -> list[Word]:
        """`tokens_to_words(ids, frames, text_of, eot, t0_ns, valid_frames, voiced)`, reusing the
        previous call's words where they cannot differ. One cache per stream and per kind of call
        (with or without `voiced`); `text_of` must be the same function on every call. `voiced` may
        also be given as `voiced_bytes(voiced[:valid_frames])` (a caller slicing many rows at once).

        The list returned is the cache's own (never changed afterwards: the next call builds a new
        one); do not modify it."""
        n, stop = _text_span(ids, frames, eot)
        end_text = stop if stop >= 0 else n
        hi = valid_frames - 1 if valid_frames > 1 else 0
        v: bytes | None
        if voiced is None or isinstance(voiced, bytes):
            v = voiced
        else:
            vm = voiced[:valid_frames]
            v = voiced_bytes(vm) if vm.shape[0] else b""
        old_words = self.words
        keep = snap = 0  # words kept unsnapped (text, start) and as they were (snapped too, with a mask)
        if (len(old_words) > 1 and t0_ns == self.t0_ns and hi >= self.hi and (v is None) == (self.v is None)
                and v != b""):
            keep = snap = self._kept(ids, frames, end_text, hi, text_of)
            if keep and v is not None:
                old = self.v
                e = self.starts[keep]  # end of word keep-1: the snapped bounds before it read the mask up to here
                # word keep-1's snapped end depends on word keep's unsnapped end: redo its snapping
                snap = 0 if not old or e > len(v) or e > len(old) or v[:e] != old[:e] else keep - 1
        if keep:
            j0 = self.opens[keep]
            last = max(frames[:j0])  # running maximum of frames 0..j0-1, clamped
            last = 0 if last < 0 else hi if last > hi else last
            texts, opens, starts = self.texts[:keep], self.opens[:keep], self.starts[:keep]
        else:
            j0 = last = 0
            texts, opens, starts = [], [], []
        last = _group(ids, frames, text_of, j0, end_text, hi, last, texts, opens, starts)
        self.ids, self.frames, self.t0_ns, self.hi, self.v = ids[:end_text], frames[:end_text], t0_ns, hi, v
        self.texts, self.opens, self.starts = texts, opens, starts
        if not texts:
            self.words, self.mids = [], []
            return self.words
        spans = list(zip(starts[snap:], starts[snap + 1 :]))  # noqa: B905 (start, next start), then the last
        spans.append((starts[-1], _last_end(frames, stop, last, starts[-1], hi, valid_frames)))
        if v:
            if snap:
                spans[0] = (self.mids[snap], spans[0][1])  # the boundary before it was moved already
            spans, mids = snap_spans(spans, v, SNAP_WINDOW, SNAP_MIN_GAP, spans[0][0] + 1)  # positional: cheaper
            self.mids = self.mids[:snap] + mids
        words = old_words[:snap]
        words += _make(texts[snap:], spans, t0_ns, old_words[snap:])
        self.words = words
        return words
