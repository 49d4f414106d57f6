"""Turn-taking, end-of-turn detectors, heard-text tracking and history; clocks."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from tristream.pipeline.prompt import Conversation, scene_relevant
from tristream.pipeline.turns import (
    EAGERNESS_HOLD_MS,
    HeardText,
    LexicalEndOfTurn,
    SemanticEndOfTurn,
    SilenceEndOfTurn,
    TurnTaker,
)
from tristream.sched.clock import VirtualClock

MS = 1_000_000


def test_silence_detector_ends_turn_at_final() -> None:
    tt = TurnTaker(SilenceEndOfTurn())
    tt.on_speech_start(100 * MS)
    turn = tt.on_final("what time is it", 100 * MS, 900 * MS, 1300 * MS)
    assert turn is not None
    assert (turn.text, turn.speech_start_ns, turn.speech_end_ns, turn.asr_final_ns) == (
        "what time is it", 100 * MS, 900 * MS, 1300 * MS)
    assert not tt.pending


def test_a_longer_silence_holds_every_turn_and_speech_within_it_continues_the_turn() -> None:
    tt = TurnTaker(SilenceEndOfTurn(), extra_silence_ms=500)
    tt.on_speech_start(0)
    assert tt.on_final("what time is it", 0, 900 * MS, 1000 * MS) is None
    assert tt.on_tick(1499 * MS) is None
    tt.on_speech_start(1400 * MS)  # the user spoke again inside the client's silence
    turn = tt.on_final("in Tokyo", 1400 * MS, 2000 * MS, 2100 * MS)
    assert turn is None and tt.on_tick(2599 * MS) is None
    turn = tt.on_tick(2600 * MS)
    assert turn is not None and turn.text == "what time is it in Tokyo"


class _Voice:
    """A turn model that says what it is told (the real Smart Turn is tested below)."""

    def __init__(self, p: float) -> None:
        self.p = p

    def probability(self, audio: object) -> float:
        return self.p


def test_semantic_detector_holds_on_an_unfinished_voice_or_dangling_words() -> None:
    import numpy as np

    audio = np.zeros(16_000, np.float32)
    low = SemanticEndOfTurn.for_eagerness("low", _Voice(0.2))
    assert low.uses_audio and low.extra_wait_ms("", audio) == EAGERNESS_HOLD_MS["low"]
    assert SemanticEndOfTurn.for_eagerness("high", _Voice(0.9)).extra_wait_ms("", audio) == 0.0
    words = SemanticEndOfTurn.for_eagerness("auto")  # no turn model installed: the words alone
    assert not words.uses_audio
    assert words.extra_wait_ms("I want to go to the") == EAGERNESS_HOLD_MS["auto"]
    assert words.extra_wait_ms("I want to go home.") == 0.0
    # the voice said finished, the words did not: the turn taker holds for the longer wait
    tt = TurnTaker(SemanticEndOfTurn.for_eagerness("medium", _Voice(0.9)))
    tt.on_speech_start(0)
    assert tt.on_final("a coffee and", 0, 900 * MS, 1000 * MS, wait_ms=0.0) is None
    assert tt.on_tick(1000 * MS + int(EAGERNESS_HOLD_MS["medium"] * MS)) is not None
    try:
        SemanticEndOfTurn.for_eagerness("eager")
    except ValueError as err:
        assert "eager" in str(err)
    else:
        raise AssertionError("an unknown eagerness must be refused")


def test_semantic_detector_with_the_real_turn_model_judges_real_speech() -> None:
    import pytest

    from tristream.pipeline.models import _turn_model

    model = _turn_model()
    if model is None:
        pytest.skip("Smart Turn is not installed (pipecat-ai wheel)")
    from tristream.stages.tts import PiperTTS

    tts = PiperTTS(deterministic=True)
    import numpy as np

    from tristream.stages.base import resample

    pcm = resample(tts.synthesize("Could you tell me what the weather will be like tomorrow?"), tts.sample_rate, 16_000)
    audio = np.concatenate([pcm.astype(np.float32), np.zeros(3200, np.float32)])
    det = SemanticEndOfTurn.for_eagerness("low", model)
    wait = det.extra_wait_ms("", audio)
    assert wait in (0.0, EAGERNESS_HOLD_MS["low"])
    assert wait == (0.0 if model.probability(audio) >= det.threshold else EAGERNESS_HOLD_MS["low"])


def test_lexical_detector_holds_then_speech_continues_the_turn() -> None:
    tt = TurnTaker(LexicalEndOfTurn(hold_ms=600))
    tt.on_speech_start(0)
    assert tt.on_final("I would like a coffee and", 0, 1000 * MS, 1200 * MS) is None
    assert tt.pending
    assert tt.on_tick(1500 * MS) is None  # still inside the hold
    tt.on_speech_start(1600 * MS)  # the user goes on: same turn
    assert not tt.pending and tt.continued == 1
    turn = tt.on_final("a croissant please.", 1600 * MS, 2500 * MS, 2700 * MS)
    assert turn is not None
    assert turn.text == "I would like a coffee and a croissant please."
    assert turn.speech_start_ns == 0 and turn.speech_end_ns == 2500 * MS


def test_lexical_detector_hold_expires_on_tick() -> None:
    tt = TurnTaker(LexicalEndOfTurn(hold_ms=600))
    assert tt.on_final("so um", 0, 1000 * MS, 1200 * MS) is None
    assert tt.on_tick(1799 * MS) is None
    turn = tt.on_tick(1800 * MS)
    assert turn is not None and turn.text == "so um"
    assert LexicalEndOfTurn().extra_wait_ms("Turn on the lights.") == 0.0


def test_final_while_user_speaks_again_keeps_the_turn_open() -> None:
    tt = TurnTaker()
    assert tt.on_final("First the eggs,", 0, 900 * MS, 1500 * MS, user_speaking=True) is None
    tt.on_speech_start(1200 * MS)
    turn = tt.on_final("then the flour.", 1200 * MS, 2000 * MS, 2600 * MS)
    assert turn is not None and turn.text == "First the eggs, then the flour."
    assert turn.turn_id == 0


def test_empty_final_is_not_a_turn() -> None:
    tt = TurnTaker()
    assert tt.on_final("  ", 0, 10, 20) is None
    assert not tt.pending


@given(st.lists(st.tuples(st.text(alphabet="abc ", min_size=1, max_size=30), st.integers(1, 5000)),
                min_size=1, max_size=6),
       st.integers(0, 40000))
def test_heard_text_is_a_word_prefix_and_monotone(pieces: list[tuple[str, int]], played: int) -> None:
    h = HeardText()
    for text, n in pieces:
        h.add(text, n)
    full = " ".join(t.strip() for t, _ in pieces if t.strip()).split()
    heard = h.heard(played).split()
    assert heard == full[: len(heard)]
    assert len(h.heard(played + 1000).split()) >= len(heard)
    if played >= h.total:
        assert heard == full


def test_heard_text_partial_piece_by_samples() -> None:
    h = HeardText()
    h.add("The capital of France is Paris.", 1000)
    h.add("It is lovely.", 500)
    assert h.heard(0) == ""
    assert h.heard(500) == "The capital of"
    assert h.heard(1000) == "The capital of France is Paris."
    assert h.heard(1250) == "The capital of France is Paris. It"


def test_conversation_prompt_has_scene_and_bounded_history() -> None:
    c = Conversation("Be brief.", max_turns=2)
    for i in range(5):
        c.add_user(f"q{i}")
        c.add_assistant(f"a{i}")
    c.add_assistant("   ")  # nothing heard: nothing recorded
    msgs = c.prompt("what do you see now?", scene="camera: 1 face (centre, mid)")
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in msgs[1:-1]] == ["q3", "a3", "q4", "a4"]
    assert msgs[-1]["role"] == "user" and "1 face" in msgs[-1]["content"]
    assert msgs[-1]["content"].endswith("what do you see now?")
    assert len(c.messages) <= 2 * 2 + 2  # the stored history is bounded too


def test_scene_goes_with_the_question_only_when_it_is_about_the_camera() -> None:
    c = Conversation("Be brief.")
    assert c.prompt("What is the capital of France?", scene="1 face")[-1]["content"] == "What is the capital of France?"
    assert "1 face" in c.prompt("Can you see me?", scene="1 face")[-1]["content"]
    assert scene_relevant("What am I holding?") and not scene_relevant("How many days are in a week?")


def test_virtual_clock_wakes_sleepers_in_order() -> None:
    async def main() -> list[int]:
        clock = VirtualClock()
        woke: list[int] = []

        async def sleeper(t: int) -> None:
            await clock.sleep_until(t)
            woke.append(t)

        tasks = [asyncio.ensure_future(sleeper(t)) for t in (30, 10, 20)]
        await asyncio.sleep(0)
        clock.advance(15)
        await asyncio.sleep(0)
        assert woke == [10]
        clock.advance(100)
        await asyncio.gather(*tasks)
        return woke

    assert asyncio.run(main()) == [10, 20, 30]


def test_a_failed_segment_loses_its_words_and_earlier_segments_still_make_the_turn() -> None:
    tt = TurnTaker(SilenceEndOfTurn())
    tt.on_speech_start(0)
    assert tt.on_failed_segment(0, 900 * MS, 1000 * MS) is None and not tt.pending  # nothing to answer
    tt.on_speech_start(2000 * MS)
    assert tt.on_final("book a table", 2000 * MS, 2800 * MS, 2900 * MS, user_speaking=True) is None
    turn = tt.on_failed_segment(3000 * MS, 3500 * MS, 3600 * MS)
    assert turn is not None and turn.text == "book a table" and turn.speech_end_ns == 3500 * MS
