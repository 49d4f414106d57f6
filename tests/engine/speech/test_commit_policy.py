"""LocalAgreement commit policy on scripted hypothesis sequences."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tristream.engine.speech.commit import LocalAgreement, Word

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
