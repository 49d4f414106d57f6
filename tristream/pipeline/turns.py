"""Turn-taking, end-of-turn detection, conversation history and what the user actually heard.

End of turn: the VAD's END edge comes after `hangover_ms` of silence (the VAD's
`min_silence_ms`); the ASR final text then goes to an `EndOfTurnDetector`, which may ask to
hold the turn open a little longer (the user paused mid-sentence). Speech that resumes while
the turn is held continues the same turn.

Default hangover, 300 ms, by measurement (`bench/pipeline.py`, results in
`bench/results/pipeline.json` under "hangover"): silero VAD over 33 synthesised sentences (11
texts, two of them full of commas, each synthesised 3 times) cut 12 sentences in two at
150 ms, 6 at 200 ms, 4 at 250 ms and none from 300 ms up. 300 ms is the smallest hangover
that never ended a turn inside a sentence; every 50 ms more adds 50 ms to every answer.
A cut that still happens is repaired when the VAD hears the user again before the ASR final
of the cut segment is ready (`TurnTaker.on_final(user_speaking=True)`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

DEFAULT_HANGOVER_MS = 300.0

BACKCHANNELS = frozenset({
    "mhm", "mm", "hmm", "hm", "mm-hmm", "mm-hm", "m-hm", "uh-huh", "uh-hum", "um-hum", "uh", "huh", "um", "yeah", "yes", "yep", "yup", "ok", "okay",
    "right", "sure", "alright", "i", "see", "got", "it", "cool", "nice", "wow", "oh", "ah", "aha",
})
"""Words of acknowledgements spoken over an answer ("mhm", "yeah", "I see", "got it")."""


class TurnModel(Protocol):
    """A model of whether a voice sounds finished (`stages.turn_model.SmartTurn`)."""

    def probability(self, pcm: np.ndarray) -> float:
        """Probability that the speech ending `pcm` is a finished turn."""
        ...


class EndOfTurnDetector(Protocol):
    """Decides, from the user's text so far or their voice, whether the turn is over.

    A detector that judges the voice sets ``uses_audio = True``: the session then calls it
    with the last seconds of audio (16 kHz mono) beside the ASR final, before the text exists.
    """

    def extra_wait_ms(self, text: str, audio: np.ndarray | None = None) -> float:
        """0 when the turn ends now; otherwise how much more silence to wait for."""
        ...


class SilenceEndOfTurn:
    """The turn ends when the VAD hangover has passed: no extra wait."""

    def extra_wait_ms(self, text: str, audio: np.ndarray | None = None) -> float:
        """Always 0."""
        return 0.0


_TRAILING = re.compile(
    r"\b(and|or|but|so|because|the|a|an|to|of|with|um|uh|er|like|my|your|if|then|is|are)\W*$",
    re.IGNORECASE,
)


@dataclass(slots=True)
class LexicalEndOfTurn:
    """Holds the turn open when the text ends in a word that cannot end a sentence ("and", "um")."""

    hold_ms: float = 600.0

    def extra_wait_ms(self, text: str, audio: np.ndarray | None = None) -> float:
        """`hold_ms` after a dangling conjunction, article or filler; 0 otherwise."""
        t = text.strip()
        if not t:
            return self.hold_ms
        return self.hold_ms if _TRAILING.search(t) else 0.0


EAGERNESS_HOLD_MS = {"high": 250.0, "medium": 700.0, "auto": 700.0, "low": 1500.0}
"""Extra silence a semantic turn detector waits for when the turn sounds or reads unfinished,
by the Realtime API's ``turn_detection.eagerness`` (``auto`` is ``medium``)."""


@dataclass(slots=True)
class SemanticEndOfTurn:
    """The Realtime API's ``semantic_vad``: after the VAD's silence, the turn is held `hold_ms`
    more when the words end in one that cannot end a sentence ("and", "the", "um"), or when the
    turn model (Smart Turn, `stages.turn_model.SmartTurn`; None: words only) says the voice is
    unfinished. It never ends a turn earlier than the silence rule: on our labelled set Smart Turn
    took 66 % of mid-sentence cuts for finished turns (`bench/e2e_cpu.py --section turn`)."""

    model: TurnModel | None = None
    hold_ms: float = EAGERNESS_HOLD_MS["auto"]
    threshold: float = 0.5

    @property
    def uses_audio(self) -> bool:
        return self.model is not None

    def extra_wait_ms(self, text: str, audio: np.ndarray | None = None) -> float:
        """With `audio` (the voice, before the text exists): the model's verdict; with `text`: the
        word rule; `hold_ms` when either says unfinished."""
        if audio is not None and audio.size and self.model is not None:
            p = float(self.model.probability(audio))
            return 0.0 if p >= self.threshold else self.hold_ms
        t = text.strip()
        return self.hold_ms if t and _TRAILING.search(t) else 0.0

    @classmethod
    def for_eagerness(cls, eagerness: str, model: TurnModel | None = None) -> SemanticEndOfTurn:
        """The detector for a ``turn_detection.eagerness`` (``low``/``medium``/``high``/``auto``)."""
        if eagerness not in EAGERNESS_HOLD_MS:
            raise ValueError(f"eagerness {eagerness!r}; expected one of {sorted(EAGERNESS_HOLD_MS)}")
        return cls(model, EAGERNESS_HOLD_MS[eagerness])


@dataclass(slots=True)
class UserTurn:
    """A finished user turn handed to the LLM stage."""

    turn_id: int
    text: str
    speech_start_ns: int
    speech_end_ns: int
    """End of the user's speech on the reference clock (the VAD's END edge)."""
    asr_final_ns: int
    """Reference-clock time the final transcript was available."""
    scene: Awaitable[Any] | None = None
    """A future/awaitable of the scene description, or None without vision."""
    speak: bool | None = None
    """Whether the answer is synthesised: None follows the session (`SessionConfig.speak`);
    a ``response.create`` with its own ``modalities`` sets it for its answer."""


@dataclass(slots=True)
class TurnTaker:
    """Collects ASR finals into turns; ends a turn once the detector's extra wait has passed."""

    detector: EndOfTurnDetector = field(default_factory=SilenceEndOfTurn)
    extra_silence_ms: float = 0.0
    """Silence to wait for beyond the VAD's hangover before any turn ends (a client's
    ``silence_duration_ms`` longer than the hangover the session's VAD started with)."""
    _texts: list[str] = field(default_factory=list)
    _start_ns: int | None = None
    _end_ns: int = 0
    _final_ns: int = 0
    _deadline_ns: int | None = None
    _next_id: int = 0
    continued: int = 0
    """Turns that resumed after the detector held them open."""

    @property
    def deadline_ns(self) -> int | None:
        """When the held turn ends unless the user speaks again (None: no turn is held)."""
        return self._deadline_ns

    @property
    def pending(self) -> bool:
        """Whether finished speech is waiting for the end-of-turn decision."""
        return self._deadline_ns is not None

    def discard(self) -> None:
        """Forget the speech collected so far (a backchannel, not a turn)."""
        self._reset()

    def text_with(self, partial: str) -> str:
        """The turn's text so far with `partial` (the open segment's words) after it."""
        return " ".join([*self._texts, partial.strip()]).strip()

    def on_speech_start(self, t_ns: int) -> None:
        """The user speaks: a held turn continues; otherwise a new turn starts."""
        if self._deadline_ns is not None:
            self.continued += 1
            self._deadline_ns = None
        if self._start_ns is None:
            self._start_ns = t_ns

    def on_final(self, text: str, start_ns: int, end_ns: int, now_ns: int,
                 user_speaking: bool = False, wait_ms: float | None = None) -> UserTurn | None:
        """A final transcript for one speech segment; returns the turn if it ends now.

        `user_speaking`: the VAD already hears the user again (the final came after the user
        resumed); the text is kept and the turn continues with the next segment. `wait_ms`: the
        extra wait an audio turn model decided (instead of the detector's from the text).
        """
        text = text.strip()
        if text:
            self._texts.append(text)
        if self._start_ns is None:
            self._start_ns = start_ns
        self._end_ns = max(self._end_ns, end_ns)
        self._final_ns = now_ns
        if not self._texts:
            self._reset()
            return None
        if user_speaking:
            self.continued += 1
            self._deadline_ns = None
            return None
        # the voice's verdict (`wait_ms`) and the words' (`detector`): the longer wait holds
        wait = max(wait_ms or 0.0, self.detector.extra_wait_ms(" ".join(self._texts))) + self.extra_silence_ms
        self._deadline_ns = now_ns + int(wait * 1e6)
        return self.on_tick(now_ns)

    def on_failed_segment(self, start_ns: int, end_ns: int, now_ns: int,
                          user_speaking: bool = False) -> UserTurn | None:
        """A segment whose transcription failed: its words are lost, and the turn's earlier
        segments (if any) still make a turn, ended as `on_final` would end it."""
        return self.on_final("", start_ns, end_ns, now_ns, user_speaking)

    def on_tick(self, now_ns: int) -> UserTurn | None:
        """Time passed without speech; returns the turn once its deadline is reached."""
        if self._deadline_ns is None or now_ns < self._deadline_ns:
            return None
        turn = UserTurn(self._next_id, " ".join(self._texts), self._start_ns or 0, self._end_ns, self._final_ns)
        self._next_id += 1
        self._reset()
        return turn

    def _reset(self) -> None:
        self._texts = []
        self._start_ns = None
        self._end_ns = 0
        self._deadline_ns = None


@dataclass(slots=True)
class HeardText:
    """Maps played-out audio back to the text it speaks, piece by piece.

    Each synthesised piece (a sentence) is added with its length in samples; `heard(n)`
    returns the text of the first `n` samples: whole pieces, then the words of a partly
    played piece in proportion to the samples played (speech rate is close to uniform
    within a sentence).
    """

    pieces: list[tuple[str, int]] = field(default_factory=list)

    def add(self, text: str, n_samples: int) -> None:
        """Append a piece of `n_samples` samples that speaks `text`."""
        self.pieces.append((text, n_samples))

    @property
    def total(self) -> int:
        """Samples of every piece added."""
        return sum(n for _, n in self.pieces)

    def heard(self, played: int) -> str:
        """The text spoken by the first `played` samples."""
        out: list[str] = []
        left = played
        for text, n in self.pieces:
            if left <= 0:
                break
            if left >= n:
                out.append(text.strip())
                left -= n
                continue
            words = text.split()
            k = int(len(words) * left / n) if n else 0
            if k:
                out.append(" ".join(words[:k]))
            break
        return " ".join(w for w in out if w)
