from __future__ import annotations

import numpy as np
import pytest

from tests.models import load_or_skip
from tristream.stages.base import ModelUnavailable
from tristream.stages.synth import energy_edges
from tristream.stages.tts import EspeakTTS, PiperTTS, SentenceSplitter, espeak_available


@pytest.fixture(scope="module")
def piper():
    return load_or_skip(lambda: PiperTTS(deterministic=True))


def test_splitter_streams_sentences_and_first_clause():
    sp = SentenceSplitter(first_clause_min_chars=10)
    got: list[str] = []
    for tok in ["Well", " then,", " I think", " so. Next", " one!", " And", " the rest"]:
        got += sp.add(tok)
    assert got == ["Well then, I think so.", "Next one!"] or got == ["Well then,", "I think so.", "Next one!"]
    assert sp.rest() == "And the rest"
    sp2 = SentenceSplitter(first_clause_min_chars=5)
    assert sp2.add("Hello there, my friend, how") == ["Hello there,"]  # only the first clause breaks at a comma
    assert sp2.add(" are you? ") == ["my friend, how are you?"]


def test_piper_streams_sentence_by_sentence(piper):
    s = piper.stream("t")
    s.push("Hello there. How are", 0)
    first = s.poll()
    assert len(first) == 1 and first[0].text == "Hello there." and first[0].seq == 0
    assert s.first_audio_s is not None and s.first_audio_s > 0
    s.push(" you today?", 0)
    s.flush()
    rest = s.poll()
    assert [a.text for a in rest] == ["How are you today?"] and rest[-1].last
    for a in first + rest:
        assert a.sample_rate == 22050 and a.pcm.dtype == np.float32
        assert 0.3 < a.duration_s < 3.0
        start, end = energy_edges(a.pcm, a.sample_rate)
        assert end - start > 0.2 * a.sample_rate  # speech, not silence


def test_interrupt_drops_unspoken_text_and_counts(piper):
    s = piper.stream("b")
    s.push("First sentence here. Second sentence is never", 0)
    played = s.poll()
    dropped = s.interrupt()
    assert [a.text for a in played] == ["First sentence here."]
    assert dropped == "Second sentence is never"
    assert s.counters["interrupted_text_chars"] == len(dropped)
    s.flush()
    assert s.poll() == []


def test_deterministic_piper_is_reproducible(piper):
    a = piper.synthesize("Testing one two three.")
    b = piper.synthesize("Testing one two three.")
    assert np.array_equal(a, b)


@pytest.mark.skipif(not espeak_available(), reason="espeak-ng library not installed (apt-get install espeak-ng)")
def test_espeak_ctypes_fallback():
    tts = EspeakTTS()
    pcm = tts.synthesize("The quick brown fox.")
    assert tts.sample_rate == 22050
    start, end = energy_edges(pcm, tts.sample_rate)
    assert 0.4 * tts.sample_rate < end - start < 3 * tts.sample_rate
    s = tts.stream("e")
    s.push("One. Two", 0)
    s.flush()
    assert [a.text for a in s.poll()] == ["One.", "Two"]


def test_piper_exact_synthesis_repeats_and_demo_input_is_fixed() -> None:
    """A lively voice (random variation on) varies between calls; `synthesize_exact` and the demo's
    spoken input (`demo_conversation`) give the same samples every time."""
    from tristream.pipeline.demo import demo_conversation

    try:
        lively = PiperTTS()
    except ModelUnavailable as e:
        pytest.skip(str(e))
    text = "What is the capital of France?"
    a, b = lively.synthesize(text), lively.synthesize(text)
    assert a.shape != b.shape or not np.array_equal(a, b)  # the default voice samples noise
    x, y = lively.synthesize_exact(text), lively.synthesize_exact(text)
    assert np.array_equal(x, y)
    first, second = demo_conversation(lively), demo_conversation(lively)
    assert len(first) == len(second) > 0
    assert all(np.array_equal(p, q) for p, q in zip(first, second, strict=True))


def test_piper_threads_do_not_spin_between_operators_unless_asked() -> None:
    try:
        quiet, spinning = PiperTTS(deterministic=True), PiperTTS(deterministic=True, spin=True)
    except ModelUnavailable as err:
        pytest.skip(str(err))
    opts = quiet._voice.session.get_session_options()
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(Exception, match="allow_spinning"):  # ONNX Runtime's default: spin
        spinning._voice.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
    assert quiet.synthesize("Hello there.").size > quiet.sample_rate // 4
