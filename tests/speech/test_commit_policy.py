"""LocalAgreement commit policy on scripted hypothesis sequences."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.speech.commit import LocalAgreement, Word

MS = 1_000_000


def hyp(text: str, start_ms: int = 0, step_ms: int = 300) -> list[Word]:
    return [Word(w, (start_ms + i * step_ms) * MS, (start_ms + (i + 1) * step_ms) * MS)
            for i, w in enumerate(text.split())]


def test_commits_prefix_on_which_two_hypotheses_agree() -> None:
    la = LocalAgreement()
    r1 = la.insert(hyp("the cat"))
    assert r1.committed == [] and [w.text for w in r1.partial] == ["the", "cat"]
    r2 = la.insert(hyp("the cat sat on"))
    assert [w.text for w in r2.committed] == ["the", "cat"]
    assert [w.text for w in r2.partial] == ["sat", "on"]
    r3 = la.insert(hyp("the cat sat in the"))
    assert [w.text for w in r3.committed] == ["sat"]
    assert [w.text for w in r3.partial] == ["in", "the"]
    r4 = la.insert(hyp("the cat sat in the hat."))
    assert [w.text for w in r4.committed] == ["in", "the"]
    fin = la.flush()
    assert [w.text for w in fin.committed] == ["hat."]
    assert [w.text for w in la.committed] == "the cat sat in the hat.".split()


def test_disagreement_commits_nothing_until_stable() -> None:
    la = LocalAgreement()
    la.insert(hyp("i scream"))
    assert la.insert(hyp("ice cream")).committed == []
    assert [w.text for w in la.insert(hyp("ice cream please")).committed] == ["ice", "cream"]


def test_case_and_punctuation_do_not_block_agreement() -> None:
    la = LocalAgreement()
    la.insert(hyp("Hello, world"))
    r = la.insert(hyp("hello world again"))
    assert [w.text for w in r.committed] == ["hello", "world"]


def test_words_from_before_a_trim_are_not_committed_twice() -> None:
    la = LocalAgreement()
    la.insert(hyp("one two three"))
    la.insert(hyp("one two three four"))
    assert [w.text for w in la.committed] == ["one", "two", "three"]
    la.forget_before(600 * MS)
    # after trimming, the buffer starts at 600 ms and the model re-hears "three" at its old time
    r1 = la.insert(hyp("three four five", start_ms=600))
    assert [w.text for w in r1.committed] == ["four"]  # agrees with the earlier partial "four"
    r2 = la.insert(hyp("three four five six", start_ms=600))
    assert [w.text for w in r2.committed] == ["five"]
    assert [w.text for w in la.committed] == ["two", "three", "four", "five"]


def test_repeated_tail_ngram_is_dropped_even_with_shifted_times() -> None:
    la = LocalAgreement()
    la.insert(hyp("good morning"))
    la.insert(hyp("good morning everyone"))
    # the model repeats the committed tail with slightly later times after a trim
    la.insert(hyp("morning everyone here", start_ms=350))
    r = la.insert(hyp("morning everyone here today", start_ms=350))
    assert [w.text for w in la.committed] == ["good", "morning", "everyone", "here"]
    assert [w.text for w in r.partial] == ["today"]


def test_local_agreement_3_waits_for_three() -> None:
    la = LocalAgreement(n=3)
    la.insert(hyp("a b"))
    assert la.insert(hyp("a b c")).committed == []
    assert [w.text for w in la.insert(hyp("a b c d")).committed] == ["a", "b"]
    with pytest.raises(ValueError, match="n >= 2"):
        LocalAgreement(n=1)


@given(st.lists(st.lists(st.sampled_from("a b c d e".split()), max_size=8), min_size=1, max_size=12))
def test_committed_text_only_grows_and_is_monotonic_in_time(seq: list[list[str]]) -> None:
    la = LocalAgreement()
    seen: list[Word] = []
    for words in seq:
        r = la.insert(hyp(" ".join(words)))
        seen.extend(r.committed)
        assert la.committed == seen
    starts = [w.start_ns for w in la.committed]
    assert starts == sorted(starts)


class FormerLocalAgreement:
    """Reference `LocalAgreement` (key lists per comparison, a result object per insert),
    pinned as the reference for the rewritten one."""

    def __init__(self, n: int = 2, tolerance_ns: int = 100_000_000, max_ngram: int = 5) -> None:
        self.n, self.tolerance_ns, self.max_ngram = n, tolerance_ns, max_ngram
        self.committed: list[Word] = []
        self._history: list[list[Word]] = []

    @staticmethod
    def _agreed(fresh: list[Word], earlier: list[list[Word]]) -> int:
        k = len(fresh)
        for h in earlier:
            k = min(k, len(h))
            for i in range(k):
                if h[i].key != fresh[i].key:
                    k = i
                    break
        return k

    def _fresh(self, hyp: list[Word]) -> list[Word]:
        end = self.committed[-1].end_ns if self.committed else -(2**62)
        words = [w for w in hyp if w.start_ns > end - self.tolerance_ns]
        if words and self.committed and abs(words[0].start_ns - end) < 10 * self.tolerance_ns:
            tail = [w.key for w in self.committed[-self.max_ngram:]]
            for k in range(min(len(tail), len(words), self.max_ngram), 0, -1):
                if tail[-k:] == [w.key for w in words[:k]]:
                    words = words[k:]
                    break
        return words

    def insert(self, hypothesis: list[Word]) -> tuple[list[Word], list[Word]]:
        fresh = self._fresh(hypothesis)
        self._history.append(fresh)
        del self._history[: -self.n]
        new: list[Word] = []
        if len(self._history) == self.n:
            new = fresh[: self._agreed(fresh, self._history[:-1])]
        if new:
            self.committed.extend(new)
            self._history = [h[len(new):] for h in self._history]
        return new, list(self._history[-1]) if self._history else []

    def pending(self, hypothesis: list[Word]) -> int:
        fresh = self._fresh(hypothesis)
        hist = [*self._history[-(self.n - 1):], fresh]
        return 0 if len(hist) < self.n else self._agreed(fresh, hist[:-1])

    def forget_before(self, t_ns: int) -> None:
        keep = [w for w in self.committed if w.end_ns >= t_ns]
        self.committed = keep if keep else self.committed[-1:]


def _next_hypothesis(rng: random.Random, prev: list[Word], t_ns: int) -> list[Word]:
    """A stream's next hypothesis: the previous one's words (mostly the same objects, as `WordCache`
    carries them over; sometimes equal copies, re-timed or re-spelled words) with a re-decoded tail,
    now and then a word repeated from the head (the n-gram rule) or one back in time."""
    keep = len(prev) - rng.randint(0, min(3, len(prev)))
    out = []
    for w in prev[:keep]:
        r = rng.random()
        if r < 0.06:
            w = Word(w.text, w.start_ns, w.end_ns)  # equal, not identical
        elif r < 0.09:
            w = Word(w.text, w.start_ns + 30 * MS, w.end_ns)  # same key, other times
        elif r < 0.11:
            w = Word(w.text.upper() + ",", w.start_ns, w.end_ns)  # other text, same key
        elif r < 0.12:
            w = Word(rng.choice(WORDS_POOL), w.start_ns, w.end_ns)
        out.append(w)
    t = out[-1].end_ns if out else t_ns
    for _ in range(rng.randint(0, 3)):
        d = rng.choice([150, 250, 400]) * MS
        text = rng.choice(WORDS_POOL) if rng.random() < 0.9 or not out else out[0].text
        out.append(Word(text, t + (-200 * MS if rng.random() < 0.05 else 0), t + d))
        t += d + rng.choice([0, 50, 200]) * MS
    return out


WORDS_POOL = ["the", "cat", "sat", "on", "a", "mat", "The", "hat.", "it's", "again"]


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([2, 3]), st.sampled_from([5, 1, 0]))
def test_local_agreement_equals_the_former_implementation(seed: int, n: int, max_ngram: int) -> None:
    rng = random.Random(seed)
    new, old = LocalAgreement(n, max_ngram=max_ngram), FormerLocalAgreement(n, max_ngram=max_ngram)
    hyp_: list[Word] = []
    t = 0
    for step in range(40):
        hyp_ = _next_hypothesis(rng, hyp_, t)
        assert new.pending(hyp_) == old.pending(hyp_)
        fresh = new.fresh(hyp_)
        assert new.pending_fresh(fresh) == old.pending(hyp_)
        want = old.insert(hyp_)
        if step % 2:
            got = new.insert_fresh(fresh)
        else:
            r = new.insert(hyp_)
            got = (r.committed, r.partial)
        assert got == want
        assert new.committed == old.committed
        if rng.random() < 0.1 and old.committed:
            cut = old.committed[len(old.committed) // 2].end_ns
            new.forget_before(cut)
            old.forget_before(cut)
            hyp_ = [w for w in hyp_ if w.start_ns >= cut]
        t = hyp_[-1].end_ns if hyp_ else t
