"""Per-session scheduler state and the knobs that shape a session's work."""

from __future__ import annotations

from dataclasses import dataclass, field

from tristream.sched.types import Tier, WorkItem


@dataclass(frozen=True, slots=True)
class WorkShape:
    """How a session's media turns into engine work."""

    asr_interval_ms: float = 240.0
    """A streaming-ASR update every this many ms while the user speaks."""
    asr_tokens_per_update: int = 2
    vision_fps: float = 2.0
    """Frames sent to the vision encoder per second (the camera itself runs at camera fps)."""
    vision_tokens_per_frame: int = 64
    """Vision tokens prefilled per encoded frame while the user speaks."""
    ring_ms: float = 2000.0
    """Input ring length: backlog / ring_ms is the watermark fill ratio."""
    decode_pace_ms: float = 50.0
    """Token k of an answer is due k * pace after the first (faster than speech needs)."""
    asr_deadline_ms: float = 240.0
    vision_deadline_ms: float = 500.0
    prefill_deadline_ms: float = 1000.0


@dataclass(slots=True)
class AnswerState:
    """A running answer (decode sequence)."""

    turn_id: int
    total: int
    produced: int
    first_ns: int
    queued: WorkItem | None = None
    last_step: int = -2


@dataclass(slots=True)
class SessionState:
    """Everything the scheduler knows about one session."""

    sid: int
    tier: Tier
    opened_ns: int
    camera_fps: float
    speaking: bool = False
    turn_id: int = 0
    gen: int = 0
    """Bumped to invalidate timers when speech stops or the session closes."""
    last_asr_done_ns: int = 0
    last_vision_done_ns: int = 0
    last_frame_index: int = -1
    last_vision_tick_ns: int = 0
    queued_asr: WorkItem | None = None
    queued_prefill: WorkItem | None = None
    queued_turn_end: WorkItem | None = None
    queued_frames: list[WorkItem] = field(default_factory=list)
    answer: AnswerState | None = None
    closed: bool = False

    def fill(self, now_ns: int, ring_ns: int) -> float:
        """Watermark fill ratio of the session's input rings (audio while speaking, video)."""
        video = (now_ns - self.last_vision_done_ns) / ring_ns if self.queued_frames else 0.0
        audio = (now_ns - self.last_asr_done_ns) / ring_ns if self.speaking and self.queued_asr else 0.0
        return min(1.0, max(video, audio, 0.0))
