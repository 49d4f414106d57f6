"""Vocabulary of the scheduler: tiers, modalities, work kinds, work items.

Times are integer nanoseconds on whatever clock drives the scheduler (a virtual clock in
the simulator, `time.perf_counter_ns` against the real engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

MS = 1_000_000
"""Nanoseconds per millisecond."""


class Tier(IntEnum):
    """SLA tier of a session; lower value = more important."""

    GOLD = 0
    SILVER = 1
    BRONZE = 2


class WorkModality(IntEnum):
    """Input modality a piece of work serves (default priority speech > vision > text)."""

    SPEECH = 0
    VISION = 1
    TEXT = 2


class Kind(IntEnum):
    """What the engine must do for an item."""

    ASR_CHUNK = 0
    """One streaming-ASR update over the latest audio (speech)."""
    VISION_FRAME = 1
    """Encode one camera frame (vision)."""
    PREFILL = 2
    """Incremental prefill of partial ASR text / vision tokens while the user speaks."""
    TURN_END = 3
    """Final ASR + prompt tail prefill at the end of a turn; completion = first answer token."""
    DECODE = 4
    """One decode token of a running answer."""


@dataclass(frozen=True, slots=True)
class TierSpec:
    """Service-level target of one tier: response latency (end of turn → first token) P99."""

    tier: Tier
    p99_target_ms: float


DEFAULT_TIERS: dict[Tier, TierSpec] = {
    Tier.GOLD: TierSpec(Tier.GOLD, 50.0),
    Tier.SILVER: TierSpec(Tier.SILVER, 150.0),
    Tier.BRONZE: TierSpec(Tier.BRONZE, 500.0),
}


@dataclass(slots=True)
class WorkItem:
    """One schedulable unit of GPU work belonging to one session.

    `tokens` is the remaining prefill length (PREFILL / TURN_END, split across steps by
    chunked prefill) or 1 for DECODE; `asr_units` / `images` count ASR windows and frames.
    """

    item_id: int
    session_id: int
    tier: Tier
    modality: WorkModality
    kind: Kind
    arrival_ns: int
    deadline_ns: int
    tokens: int = 0
    asr_units: int = 0
    images: int = 0
    turn_id: int = -1
    token_index: int = 0
    frame_index: int = -1
    delayed: bool = False
    """Set when a DELAY timeout demoted the item to the lowest base rank."""
    turn_end_ns: int = 0
    """For TURN_END: the moment the user's turn ended (latency is measured from here)."""
    meta: dict[str, int] = field(default_factory=dict)


class SessionRefused(RuntimeError):
    """Raised when admission control refuses a new session under overload."""


class UnknownSession(KeyError):
    """Raised for an event that names a session the scheduler does not know."""
