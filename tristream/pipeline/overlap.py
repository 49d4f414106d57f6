"""Speech heard while the assistant answers: its own echo, an acknowledgement, or a new turn.

A VAD start during the answer is judged before it interrupts (`SpeechOverAnswer`):

- *echo*: the echo gate (`stages/echo.py`) explains the segment by what the session played;
  it never interrupts, and its transcript is dropped unless its words are not the answer's
  (then it was the user, quieter than the gate expected);
- *the user*: playout pauses at once. An acknowledgement (fewer than two words beyond the
  backchannel list, the answer's own words and fragments) resumes the answer; more words, or
  voice for longer than `SessionConfig.backchannel_max_ms`, interrupt it (`Session.barge_in`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tristream.pipeline.session import Session

__all__ = ["SpeechOverAnswer", "mostly_within", "words_of"]


def words_of(text: str) -> list[str]:
    """Lower-case words of `text` without the punctuation around them."""
    return [w for w in (w.strip(".,!?;:'\"").lower() for w in text.split()) if w]


def mostly_within(text: str, vocab: set[str], share: float = 0.6) -> bool:
    """Whether most words of `text` are in `vocab` (an ASR of the answer's own echo)."""
    words = words_of(text)
    if not words:
        return True
    return sum(w in vocab for w in words) >= share * len(words)


class SpeechOverAnswer:
    """The judge of one session's speech over its answers, with counters of each verdict."""

    def __init__(self, session: Session) -> None:
        self.s = session
        self.pending_ns: int | None = None
        """When speech over the answer paused it, not yet judged a backchannel or a turn."""
        self.echo_segment = False
        """The VAD's current speech segment started over the answer and the echo explains it."""
        self.drop_final = False
        """The next final transcript is of an echo segment: not a user turn."""
        self.counts: dict[str, int] = {"echo_ignored": 0, "backchannels": 0, "interruptions": 0}
        self._vocab_of: tuple[str, set[str]] = ("", set())

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    @property
    def open(self) -> bool:
        """Whether speech over the answer is being judged (an echo segment or a paused answer)."""
        return self.echo_segment or self.pending_ns is not None

    def _answer_vocab(self) -> set[str]:
        """Words of the answer so far (recomputed only when the answer grew)."""
        cur = self.s.current
        text = cur.answer if cur is not None else ""
        if text != self._vocab_of[0]:
            self._vocab_of = (text, set(words_of(text)))
        return self._vocab_of[1]

    def begin(self, t_ns: int) -> None:
        """The VAD heard speech start at `t_ns` while the assistant answers."""
        echo = self.s.echo
        if echo is not None and not echo.recent_user():
            self.echo_segment = True
            self.counts["echo_ignored"] += 1
            return
        self._user_begins(t_ns)

    def _user_begins(self, t_ns: int) -> None:
        if self.s.config.backchannel_max_ms <= 0:
            self.counts["interruptions"] += 1
            self.s.barge_in(t_ns)
            return
        self.pending_ns = t_ns
        self.s.playout.pause()  # no answer audio goes out while the user speaks

    def judge(self, speaking: bool, voiced: bool = True) -> None:
        """Per input chunk while speech overlaps the answer: the echo segment turns out to be the
        user (their voice now dominates), or the overlap outlasts a backchannel (a turn).
        `voiced`: the VAD hears voice now (not the silence of its hangover)."""
        s = self.s
        now = s.clock.now_ns()
        if self.echo_segment:
            if not speaking:
                self.echo_segment = False
                self.drop_final = True
            elif s.echo is not None and s.echo.recent_user():
                self.echo_segment = False
                self._count("echo_was_user_by_level")
                self._user_begins(now)
            return
        if (self.pending_ns is not None and speaking and voiced
                and now - self.pending_ns > s.config.backchannel_max_ms * 1e6):
            began, self.pending_ns = self.pending_ns, None
            self.counts["interruptions"] += 1
            s.barge_in(began)

    def partial(self, text: str) -> None:
        """Committed words of speech over the answer: mostly words the answer does not hold
        (three or more, under 40 % of them the answer's) mean the segment the echo gate took
        for echo is the user's (quieter than it expected). Whisper mishears a reverberant echo
        often enough that a looser rule (two words, under 60 %) stopped 5 of 18 answers on a
        simulated speakerphone (`bench/e2e_cpu.py --section overlap`)."""
        if (self.echo_segment and len(words_of(text)) >= 3
                and not mostly_within(text, self._answer_vocab(), share=0.4)):
            self.echo_segment = False
            self._count("echo_was_user_by_words")
            self._user_begins(self.s.clock.now_ns())

    def final(self, text: str) -> bool:
        """The final transcript of speech that overlapped the answer; True if it is consumed here
        (an echo segment, or a backchannel after which the answer resumes)."""
        s = self.s
        vocab = self._answer_vocab()
        if self.drop_final:
            self.drop_final = False
            if mostly_within(text, vocab):
                self._count("echo_dropped")
                return True
            if not self._a_turn(text, vocab):  # an acknowledgement over the echo: the answer goes on
                self._count("echo_with_backchannel")
                s.turns.discard()
                return True
            # words of a turn, not the answer's: the user spoke (quieter than the echo gate expected)
            self._count("echo_was_user_by_final_words")
            self.counts["interruptions"] += 1
            s.barge_in(s.clock.now_ns())
            return False
        if self.pending_ns is None:
            return False
        began, self.pending_ns = self.pending_ns, None
        if not self._a_turn(text, vocab):
            self.counts["backchannels"] += 1
            s.turns.discard()
            s.playout.resume()
            return True
        self.counts["interruptions"] += 1
        s.barge_in(began)
        return False

    def _a_turn(self, text: str, vocab: set[str]) -> bool:
        """Whether speech over the answer says more than an acknowledgement: a word that asks the
        answer to stop ("stop", "wait"), or two words of neither the answer (its echo in the same
        segment) nor the acknowledgements, nor one- or two-letter fragments."""
        words = words_of(text)
        if any(w in STOP_WORDS and w not in vocab for w in words):
            return True
        cfg = self.s.config
        content = [w for w in words if w not in vocab and w not in cfg.backchannels and len(w.replace("'", "")) > 2]
        return len(content) >= 2


STOP_WORDS = frozenset({"stop", "wait", "hold", "pause", "quiet", "enough"})
"""One of these over the answer interrupts it alone (an acknowledgement needs two other words)."""
