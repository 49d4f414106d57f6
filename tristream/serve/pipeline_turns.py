"""Turn control for `PipelineBackend`: manual commits, held turns and images as camera frames.

The pipeline ends a user turn by its own VAD and answers it at once. The Realtime protocol
also lets the client take over:

- ``turn_detection: null`` (manual mode): audio is kept in a `ManualAudioBuffer` (the
  pipeline's VAD never sees it) and ``input_audio_buffer.commit`` ends the turn; the buffer
  is transcribed by the session's ASR model as one utterance (`transcribe_utterance`) while
  the camera frames aligned to it are described, exactly as at a VAD end of turn.
- ``create_response: false`` (and manual mode, where OpenAI never answers by itself): the
  finished turn is held by a `TurnGate` between the ASR stage and the LLM stage until
  ``response.create``; turns that end meanwhile are merged into the held one.
- ``input_image`` content parts are decoded (`decode_image`) and filed in the session's
  frame ring, the same path the video extension feeds, so the next answer's scene
  description (as-of join at the end of the turn) includes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tristream.serve.media import MediaError

MANUAL_BUFFER_S = 60.0
"""Longest manual-mode turn kept (OpenAI's commit limit is 15 MiB of pcm16, ~5 min at 24 kHz);
audio beyond it is dropped and counted (``manual_audio_dropped_full``)."""


class ManualAudioBuffer:
    """16 kHz float32 audio of the user's uncommitted turn, with its reference-clock span."""

    def __init__(self, max_s: float = MANUAL_BUFFER_S, rate: int = 16_000) -> None:
        self.rate = rate
        self.max_samples = int(max_s * rate)
        self.chunks: list[np.ndarray] = []
        self.samples = 0
        self.start_ns: int | None = None
        self.end_ns = 0

    def add(self, pcm: np.ndarray, ref_ns: int) -> bool:
        """Keep one chunk whose first sample was captured at ``ref_ns``; False when full (dropped)."""
        if self.samples + pcm.size > self.max_samples:
            return False
        if self.start_ns is None:
            self.start_ns = ref_ns
        self.chunks.append(pcm)
        self.samples += pcm.size
        self.end_ns = ref_ns + pcm.size * 1_000_000_000 // self.rate
        return True

    def take(self) -> tuple[np.ndarray, int, int]:
        """The whole buffer (samples, start ns, end ns); the buffer is empty afterwards."""
        pcm = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        start, end = self.start_ns if self.start_ns is not None else self.end_ns, self.end_ns
        self.clear()
        return pcm, start, end

    def clear(self) -> None:
        """Drop everything buffered."""
        self.chunks = []
        self.samples = 0
        self.start_ns = None


def transcribe_utterance(asr: Any, session_id: str, pcm: np.ndarray, start_ns: int, end_ns: int) -> str:
    """Final transcript of ``pcm`` as one utterance through a fresh stream of the ASR model.

    Runs in a worker thread. The stream sees the same START / audio / END sequence the VAD
    would give it, so long turns are split and decoded exactly as in VAD mode.
    """
    from tristream.observe.events import SpeechEvent, SpeechEventKind

    stream = asr.stream(f"{session_id}.manual", partial_every_s=None)
    try:
        stream.push(SpeechEvent(session_id, SpeechEventKind.START, start_ns, start_ns, 0, 1.0))
        stream.push(pcm, start_ns)
        stream.push(SpeechEvent(session_id, SpeechEventKind.END, end_ns, end_ns, int(pcm.size), 0.0,
                                start_ns=start_ns))
        stream.flush()
        return " ".join(t.text.strip() for t in stream.poll() if t.final and t.text.strip())
    finally:
        stream.close()


def decode_image(data: bytes) -> np.ndarray:
    """An ``input_image`` (JPEG or PNG bytes) as an RGB uint8 array; `MediaError` when undecodable."""
    import cv2

    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if bgr is None:
        raise MediaError(f"the input_image ({len(data)} bytes) could not be decoded as JPEG or PNG")
    return np.ascontiguousarray(bgr[:, :, ::-1])


class TurnGate:
    """Stands for the LLM stage's inbox behind the ASR stage: passes turns, or holds them.

    ``hold`` is read at each turn (the session's ``create_response``). A held turn waits in
    ``held`` until `release`; a second turn that ends meanwhile joins it (one answer covers
    both, like OpenAI's conversation with two user items before a ``response.create``).
    """

    def __init__(self, inbox: Any, hold: Any, count: Any) -> None:
        self.inbox = inbox
        self.hold = hold
        self.count = count
        self.held: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inbox, name)

    def put_data(self, item: Any) -> bool:
        """A `UserTurn` is held when the session answers only on ``response.create``."""
        from tristream.pipeline.turns import UserTurn

        if type(item) is UserTurn and self.hold():
            self.keep(item)
            return True
        return bool(self.inbox.put_data(item))

    def put_control(self, item: Any) -> None:
        """Control packets (end of stream) pass."""
        self.inbox.put_control(item)

    def keep(self, turn: Any) -> None:
        """Hold ``turn`` (merged into a turn already held)."""
        self.count("turns_held")
        if self.held is None:
            self.held = turn
            return
        self.count("held_turns_merged")
        h = self.held
        h.text = f"{h.text} {turn.text}".strip()
        h.speech_end_ns, h.asr_final_ns = turn.speech_end_ns, turn.asr_final_ns
        if turn.scene is not None:
            h.scene = turn.scene

    def release(self) -> Any:
        """The held turn (or None); the gate is empty afterwards."""
        turn, self.held = self.held, None
        return turn
