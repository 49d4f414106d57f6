"""LocalAgreement-n commit policy for streaming ASR (whisper_streaming's HypothesisBuffer idea).

Each update re-transcribes the audio buffer and hands the policy a hypothesis: words with times on
the reference clock. A word becomes final once the last `n` hypotheses agree on it (same word at
the same place after what is already committed); the rest of the newest hypothesis is the partial.
Words that start before the committed end (re-heard after a buffer trim) are skipped, and an
n-gram of the hypothesis head that repeats the committed tail is dropped.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_NORM = re.compile(r"[^\w']+")


@functools.lru_cache(maxsize=1 << 16)
def _key(text: str) -> str:
    """Comparison form of a word (a few hundred words per update, from a small vocabulary: cached)."""
    return _NORM.sub("", text.lower())


class Word:
    """One recognised word with start and end on the reference clock (ns). A value: treat it as
    immutable (equality and hash over text, start, end).

    A plain slots class rather than a frozen dataclass: a 16-stream update builds ~600 of them,
    and the frozen dataclass's ``object.__setattr__`` initialiser took 0.88 µs each (0.19 here)."""

    __slots__ = ("text", "start_ns", "end_ns", "key")
    text: str
    start_ns: int
    end_ns: int
    key: str
    """Comparison form: case and punctuation folded (computed once: every update compares it)."""

    def __init__(self, text: str, start_ns: int, end_ns: int) -> None:
        self.text = text
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.key = _key(text)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Word):
            return NotImplemented
        return self.text == other.text and self.start_ns == other.start_ns and self.end_ns == other.end_ns

    def __hash__(self) -> int:
        return hash((self.text, self.start_ns, self.end_ns))

    def __repr__(self) -> str:
        return f"Word(text={self.text!r}, start_ns={self.start_ns}, end_ns={self.end_ns})"


def _agreed(fresh: list[Word], earlier: list[list[Word]]) -> int:
    """Length of the longest prefix of `fresh` whose keys every hypothesis in `earlier` starts with."""
    k = len(fresh)
    for h in earlier:
        if len(h) < k:
            k = len(h)
        # equal words have equal keys: skip the longest equal prefix with list compares (C loops; the
        # words a stream carries over between hypotheses are the same objects), then compare keys
        i = common_prefix(h, fresh, k)
        while i < k:
            if h[i].key != fresh[i].key:
                k = i
                break
            i += 1
    return k


def common_prefix(a: Sequence[Any], b: Sequence[Any], n: int) -> int:
    """Length of the common prefix of `a[:n]` and `b[:n]` (lists: slice compares run as C loops, no
    per-item Python). Searched downwards from `n` in doubling steps, then bisected: a stream's next
    hypothesis (words, tokens, frames) usually differs from its last only in the newest few items."""
    if a[:n] == b[:n]:
        return n
    hi, d, lo = n, 1, n - 1  # a[:hi] != b[:hi]
    while lo > 0 and a[:lo] != b[:lo]:
        hi = lo
        d += d
        lo = n - d if n > d else 0
    while hi - lo > 1:  # a[:lo] == b[:lo]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(slots=True)
class CommitResult:
    """What one update added: newly committed words and the current partial tail."""

    committed: list[Word]
    partial: list[Word]


@dataclass(slots=True)
class LocalAgreement:
    """Commit the longest prefix on which the last `n` hypotheses agree (n=2: LocalAgreement-2)."""

    n: int = 2
    tolerance_ns: int = 100_000_000
    max_ngram: int = 5
    committed: list[Word] = field(default_factory=list)
    _history: list[list[Word]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.n < 2:
            raise ValueError(f"LocalAgreement needs n >= 2 (got {self.n}); n=1 would commit every hypothesis")

    @property
    def committed_end_ns(self) -> int:
        return self.committed[-1].end_ns if self.committed else -(2**62)

    def fresh(self, hypothesis: list[Word]) -> list[Word]:
        """The part of `hypothesis` that the committed text does not cover yet: what `insert` and
        `pending` work on (`insert_fresh`, `pending_fresh` take it; valid until the state changes)."""
        committed = self.committed
        if not committed:
            after = -(2**62) - self.tolerance_ns
            return [w for w in hypothesis if w.start_ns > after]
        end = committed[-1].end_ns
        after = end - self.tolerance_ns
        words = [w for w in hypothesis if w.start_ns > after]
        if words and abs(words[0].start_ns - end) < 10 * self.tolerance_ns:
            tail = committed[-self.max_ngram :]
            first = words[0].key
            for k in range(min(len(tail), len(words), self.max_ngram), 0, -1):
                # the committed tail's last k words repeat the head's first k (its first word checked first)
                if tail[-k].key == first and all(a.key == b.key for a, b in zip(tail[-k:], words[:k], strict=True)):
                    return words[k:]
        return words

    def insert(self, hypothesis: list[Word]) -> CommitResult:
        """Take the newest full hypothesis; return newly committed words and the partial."""
        return CommitResult(*self.insert_fresh(self.fresh(hypothesis)))

    def insert_fresh(self, fresh: list[Word]) -> tuple[list[Word], list[Word]]:
        """`insert` of a hypothesis given as its `fresh` part; (newly committed words, partial) as a
        pair: `StreamingWhisper` repackages them into its event anyway."""
        history = self._history
        history.append(fresh)
        if len(history) > self.n:
            del history[: -self.n]
        new: list[Word] = []
        if len(history) == self.n:
            k = _agreed(fresh, history[:-1])
            if k:
                new = fresh[:k]
                self.committed.extend(new)
                self._history = [h[k:] for h in history]
        return new, self._history[-1][:]

    def pending(self, hypothesis: list[Word]) -> int:
        """How many words `insert(hypothesis)` would commit, without changing any state (used to
        decide whether an update needs exact word times before it is inserted)."""
        return self.pending_fresh(self.fresh(hypothesis))

    def pending_fresh(self, fresh: list[Word]) -> int:
        """`pending` of a hypothesis given as its `fresh` part."""
        hist = [*self._history[-(self.n - 1):], fresh] if self.n > 1 else [fresh]
        if len(hist) < self.n:
            return 0
        return _agreed(fresh, hist[:-1])

    def flush(self) -> CommitResult:
        """End of stream: commit the newest partial as final."""
        tail = list(self._history[-1]) if self._history else []
        self.committed.extend(tail)
        self._history.clear()
        return CommitResult(tail, [])

    def forget_before(self, t_ns: int) -> None:
        """Drop committed words ending before `t_ns` (after the audio buffer is trimmed there)."""
        keep = [w for w in self.committed if w.end_ns >= t_ns]
        self.committed = keep if keep else self.committed[-1:]
