"""`SpeechOverAnswer`'s verdicts on the words of speech over an answer (the session around it is
a stand-in with the attributes the judge reads; real sessions on a simulated speakerphone are in
`test_streaming_turns.py` and `bench/e2e_cpu.py --section overlap`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tristream.pipeline.overlap import SpeechOverAnswer
from tristream.pipeline.session import SessionConfig
from tristream.pipeline.turns import TurnTaker
from tristream.sched.clock import VirtualClock

ANSWER = "Once upon a time a brave little mouse lived under the old kitchen floor and waited for the cat"


class _Playout:
    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


def _judge() -> tuple[SpeechOverAnswer, SimpleNamespace]:
    s = SimpleNamespace(current=SimpleNamespace(answer=ANSWER), config=SessionConfig(), echo=None,
                        clock=VirtualClock(start_ns=10**9), turns=TurnTaker(), playout=_Playout(), barged=[])
    s.barge_in = s.barged.append
    return SpeechOverAnswer(s), s  # type: ignore[arg-type]


@pytest.mark.parametrize("text,interrupts", [
    ("Mhm.", False), ("I see, yeah.", False), ("Okay, the little mouse.", False),  # echo words + an acknowledgement
    ("Stop.", True), ("Wait, what?", True),  # one stop word is enough
    ("Tell me about trains instead.", True),
])
def test_a_paused_answer_resumes_after_an_acknowledgement_and_stops_for_a_turn(text: str, interrupts: bool) -> None:
    judge, s = _judge()
    judge.begin(2 * 10**9)  # no echo gate: the user
    assert s.playout.paused
    consumed = judge.final(text)
    assert consumed is (not interrupts)
    assert bool(s.barged) is interrupts and s.playout.paused is interrupts


@pytest.mark.parametrize("text,interrupts", [
    ("the old kitchen floor", False),  # the echo, heard back
    ("Uh-huh, little mouse under the", False),  # an acknowledgement over the echo
    ("I see waited mouse", False),
    ("What time is it in Tokyo?", True),  # a quiet user the gate took for echo
])
def test_an_echo_segment_interrupts_only_with_the_words_of_a_turn(text: str, interrupts: bool) -> None:
    judge, s = _judge()
    judge.echo_segment = True
    judge.judge(speaking=False)  # the segment ended as echo: its final decides
    assert judge.drop_final
    assert judge.final(text) is (not interrupts)
    assert bool(s.barged) is interrupts


def test_a_stop_word_the_answer_itself_says_is_its_echo() -> None:
    judge, s = _judge()
    s.current.answer = ANSWER + " Please wait here."
    judge.echo_segment = True
    judge.judge(speaking=False)
    assert judge.final("wait here please kitchen") is True and not s.barged
