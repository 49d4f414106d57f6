"""The one event vocabulary of a conversation, from the input stage to the socket.

Every layer that carries a conversation uses these types: the stages (a VAD edge, a
transcript, a synthesised piece), the session's stages between themselves (audio and frames
in, answer text, the end of an answer's text), the session's observers (`Session.subscribe`:
the server, the recorder, the demo) and the server, which turns them into Realtime events.
They sit in the bottom layer so that every layer above can import them.

Times: ``*_ns`` are reference-clock nanoseconds (monotonic); ``audio_ms`` counts the session's
input audio; ``sample_index`` counts 16 kHz input samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

SPEECH_RATE = 16_000
"""Sample rate of the audio inside a session (`AudioIn`, the VAD and the ASR): every input is
converted to it once, at the edge (`tristream.stages.base.Resampler`)."""

# ---- inputs -------------------------------------------------------------------------------


@dataclass(slots=True)
class AudioIn:
    """A chunk of 16 kHz mono float32 microphone audio; `ref_ns` is its first sample's capture time."""

    pcm: np.ndarray
    ref_ns: int


@dataclass(slots=True)
class FrameIn:
    """A decoded camera frame (HxWx3 uint8 RGB) captured at `ref_ns`."""

    image: np.ndarray
    ref_ns: int


@dataclass(slots=True)
class EncodedFrame:
    """A camera frame as the client sent it (JPEG or raw), with its capture time on the client's clock (µs)."""

    data: bytes
    format: str
    capture_ts_us: int
    width: int | None
    height: int | None
    stream_id: str
    ref_ns: int


# ---- what the stages find -----------------------------------------------------------------


class SpeechEventKind(StrEnum):
    """What a VAD event marks."""

    START = "start"
    END = "end"


@dataclass(slots=True, frozen=True)
class SpeechEvent:
    """A speech edge from the VAD: `t_ns` is the edge, `decided_ns` when it became known."""

    session_id: str
    kind: SpeechEventKind
    t_ns: int
    decided_ns: int
    sample_index: int
    probability: float
    start_ns: int | None = None
    """For END events: the START edge of the segment that ends here."""


@dataclass(slots=True, frozen=True)
class SilenceOnset:
    """The VAD has heard enough silence inside an utterance to speculate (marker, in audio order)."""

    sample_index: int
    t_ns: int
    """Reference time of the first silent sample (≈ the end of speech)."""


@dataclass(slots=True, frozen=True)
class SpeechResumed:
    """The user spoke again after a `SilenceOnset` (marker, in audio order)."""

    sample_index: int


@dataclass(slots=True, frozen=True)
class Transcript:
    """ASR text for one utterance: partials while speaking, one final after the end."""

    session_id: str
    text: str
    final: bool
    start_ns: int
    end_ns: int
    decided_ns: int
    compute_s: float
    """Wall seconds the model spent producing this hypothesis (for latency tables)."""


@dataclass(slots=True, frozen=True)
class FailedTranscript(Transcript):
    """A final whose decode raised: ``text`` is empty, ``error`` the exception in one line."""

    error: str = ""


@dataclass(slots=True, frozen=True)
class SceneDescription:
    """A compact text description of one video frame for a text-only LLM."""

    session_id: str
    ref_ns: int
    text: str
    faces: tuple[tuple[str, float], ...]
    """(position word, relative size) per face, left to right."""
    motion: float
    brightness: float
    compute_s: float


@dataclass(slots=True, frozen=True)
class AudioOut:
    """A piece of synthesised speech: `pcm` mono float32 at `sample_rate`."""

    session_id: str
    pcm: np.ndarray
    sample_rate: int
    text: str
    """The sentence this audio speaks (history keeps only what was actually played)."""
    seq: int
    last: bool
    compute_s: float

    @property
    def duration_s(self) -> float:
        """Seconds of audio in this piece."""
        return float(self.pcm.shape[0]) / self.sample_rate


# ---- the answer inside the session --------------------------------------------------------


@dataclass(slots=True)
class AnswerText:
    """A text delta of an answer (LLM → TTS inside the session; session → server outside it).

    `speak`: the TTS stage synthesises it (the answer's modalities include audio)."""

    text: str
    ref_ns: int = 0
    turn_id: int = -1
    speak: bool = True


@dataclass(slots=True)
class ReplyEnd:
    """The answer's text to `turn_id` is complete (its audio may still be playing)."""

    turn_id: int
    speak: bool = True


# ---- what a session's observers see (and the server sends) --------------------------------


@dataclass(slots=True)
class SpeechStarted:
    """The VAD found the start of a user turn at ``audio_ms`` into the session's audio."""

    audio_ms: int
    ref_ns: int


@dataclass(slots=True)
class SpeechStopped:
    """The VAD found the end of the user turn (``audio_ms`` into the session's audio)."""

    audio_ms: int
    ref_ns: int


@dataclass(slots=True)
class TranscriptDelta:
    """The transcript hypothesis so far (full text, not an increment) of the current user turn."""

    text: str
    ref_ns: int


@dataclass(slots=True)
class TranscriptDone:
    """Final transcript of the user turn; ``words``: (word, start_ms, end_ms) in ms of the session's
    audio (the axis of ``audio_start_ms``), when the ASR times its words."""

    text: str
    ref_ns: int
    words: list[tuple[str, int, int]] | None = None
    error: str = ""
    """The transcription failed (the exception in one line): the turn's audio is lost and the
    client is told (``conversation.item.input_audio_transcription.failed``)."""


@dataclass(slots=True)
class ResponseStarted:
    """The assistant began an answer (after a turn end, ``response.create`` or text input)."""

    ref_ns: int


@dataclass(slots=True)
class AnswerAudio:
    """Streaming answer audio as it plays: int16 mono PCM at the client's output rate."""

    pcm: np.ndarray
    ref_ns: int


@dataclass(slots=True)
class ResponseDone:
    """The answer ended: ``completed``, ``cancelled`` (barge-in / response.cancel) or ``failed``."""

    status: str
    ref_ns: int
    reason: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


SessionEvent = (
    SpeechStarted | SpeechStopped | TranscriptDelta | TranscriptDone | ResponseStarted | AnswerText
    | AnswerAudio | ResponseDone
)
"""What a session tells its observers, in order."""

EventSink = Callable[[SessionEvent], None]


# ---- an answer turn on the scheduled engine -----------------------------------------------


@dataclass(slots=True, frozen=True)
class TurnDelta:
    """Answer text decoded for a scheduled turn."""

    text: str


@dataclass(slots=True, frozen=True)
class TurnEnd:
    """A scheduled turn ended: ``done`` (with the engine's finish reason), ``shed`` (the scheduler
    dropped it, with its reason) or ``error`` (with the message)."""

    kind: str
    detail: str


TurnEvent = TurnDelta | TurnEnd
