"""Admission control and shedding, Triton-like, plus the degradation ladder.

* Per-tier queue policy (Triton's `ModelQueuePolicy`): a maximum queue size (new items are
  rejected when full) and per-kind timeouts with action REJECT (drop the item) or DELAY
  (keep it but demote it to the lowest rank).
* Under sustained overload a ladder escalates one level at a time: drop stale video (keep
  the newest frame per session) → lower the vision rate → shorten answers → refuse new
  sessions with `SessionRefused`. It relaxes one level at a time when pressure falls.
  Gold is exempt from the ladder by default.
* Every shed item lands in `ShedLedger` with a reason, tier and kind.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

from tristream.sched.types import MS, Kind, Tier


class TimeoutAction(StrEnum):
    """What happens to an item that waited longer than its timeout."""

    REJECT = "reject"
    DELAY = "delay"


class ShedReason(StrEnum):
    """Why an item (or a part of one) was not served.

    Units: work items for QUEUE_FULL / TIMEOUT / STALE_VIDEO, sampling ticks (frames) for
    VISION_RATE, answer tokens for ANSWER_SHORTENED / ANSWER_ABORTED, sessions for
    SESSION_REFUSED.
    """

    QUEUE_FULL = "queue_full"
    TIMEOUT = "timeout"
    STALE_VIDEO = "stale_video"
    VISION_RATE = "vision_rate_lowered"
    ANSWER_SHORTENED = "answer_shortened"
    ANSWER_ABORTED = "answer_aborted"
    SESSION_REFUSED = "session_refused"


class Level(IntEnum):
    """Degradation levels, in the order they are applied."""

    NORMAL = 0
    DROP_STALE_VIDEO = 1
    LOWER_VISION_RATE = 2
    SHORTEN_ANSWERS = 3
    REFUSE_NEW_SESSIONS = 4


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """Queue limits of one tier; kinds absent from `timeouts_ms` never time out."""

    max_queue_size: int = 4096
    timeouts_ms: dict[Kind, float] = field(default_factory=dict)
    actions: dict[Kind, TimeoutAction] = field(default_factory=dict)

    def action(self, kind: Kind) -> TimeoutAction:
        """Timeout action for `kind` (REJECT unless configured)."""
        return self.actions.get(kind, TimeoutAction.REJECT)


def default_queue_policies() -> dict[Tier, QueuePolicy]:
    """Gold never times out; silver/bronze reject late turns, frames and decode tokens."""
    late = {Kind.TURN_END: 1000.0, Kind.ASR_CHUNK: 1000.0, Kind.VISION_FRAME: 500.0,
            Kind.PREFILL: 1000.0, Kind.DECODE: 2000.0}
    acts = {Kind.PREFILL: TimeoutAction.DELAY}
    return {
        Tier.GOLD: QueuePolicy(max_queue_size=4096),
        Tier.SILVER: QueuePolicy(max_queue_size=2048, timeouts_ms=dict(late), actions=dict(acts)),
        Tier.BRONZE: QueuePolicy(max_queue_size=1024, timeouts_ms=dict(late), actions=dict(acts)),
    }


class ShedLedger:
    """Counts of shed work by (reason, tier, kind), and of non-shed notable events."""

    def __init__(self) -> None:
        self.shed: Counter[tuple[ShedReason, Tier, Kind | None]] = Counter()
        self.events: Counter[str] = Counter()

    def add(self, reason: ShedReason, tier: Tier, kind: Kind | None, n: int = 1) -> None:
        """Count `n` shed units (kind None = a whole session)."""
        if n > 0:
            self.shed[(reason, tier, kind)] += n

    def note(self, name: str, n: int = 1) -> None:
        """Count a non-shed event (merges, barge-in cancellations, unsampled frames)."""
        self.events[name] += n

    def total(self, reason: ShedReason | None = None, tier: Tier | None = None, kind: Kind | None = None) -> int:
        """Sum of counts matching the given filters."""
        return sum(
            n for (r, t, k), n in self.shed.items()
            if (reason is None or r is reason) and (tier is None or t is tier) and (kind is None or k is kind)
        )

    def to_dict(self) -> dict[str, int]:
        """Flat `reason/tier/kind -> count` mapping for JSON."""
        out: dict[str, int] = {}
        for (r, t, k), n in self.shed.items():
            out[f"{r.value}/{t.name.lower()}/{'session' if k is None else k.name.lower()}"] = n
        return dict(sorted(out.items()))


@dataclass(frozen=True, slots=True)
class LadderConfig:
    """When and how hard to degrade."""

    max_late_decode_fraction: float = 0.2
    """Share of decode tokens delivered after their pace deadline that counts as pressure 1.0."""
    escalate_pressure: float = 1.0
    relax_pressure: float = 0.6
    escalate_after_ms: float = 300.0
    relax_after_ms: float = 3000.0
    vision_rate_factor: float = 0.25
    short_answer_tokens: int = 24
    exempt: frozenset[Tier] = frozenset({Tier.GOLD})
    max_level: Level = Level.REFUSE_NEW_SESSIONS


class DegradationLadder:
    """Hysteresis state machine over `Level`, fed with the worst tier pressure (P99/target)."""

    def __init__(self, config: LadderConfig | None = None) -> None:
        self.config = config or LadderConfig()
        self.level = Level.NORMAL
        self._over_since: int | None = None
        self._under_since: int | None = None
        self.transitions: list[tuple[int, Level]] = []

    def update(self, now_ns: int, pressure: float | None, relax: float | None = None) -> Level:
        """Feed the current pressure; may move one level up or down.

        `relax` (default: `pressure`) is the signal for stepping down; the scheduler passes
        the pressure of the tiers the ladder degrades, since an exempt tier that always runs
        near its target would otherwise hold the ladder up forever.
        """
        c = self.config
        if pressure is None:
            return self.level
        if relax is None:
            relax = pressure
        if pressure > c.escalate_pressure:
            self._under_since = None
            if self._over_since is None:
                self._over_since = now_ns
            elif now_ns - self._over_since >= c.escalate_after_ms * MS and self.level < c.max_level:
                self.level = Level(self.level + 1)
                self._over_since = now_ns
                self.transitions.append((now_ns, self.level))
        elif relax < c.relax_pressure:
            self._over_since = None
            if self._under_since is None:
                self._under_since = now_ns
            elif now_ns - self._under_since >= c.relax_after_ms * MS and self.level > Level.NORMAL:
                self.level = Level(self.level - 1)
                self._under_since = now_ns
                self.transitions.append((now_ns, self.level))
        else:
            self._over_since = None
            self._under_since = None
        return self.level

    def applies(self, level: Level, tier: Tier) -> bool:
        """Whether degradation `level` is in force for sessions of `tier`."""
        return self.level >= level and tier not in self.config.exempt

    def refuse_message(self, tier: Tier) -> str:
        """Actionable error text for a refused session."""
        return (f"server overloaded (degradation level {int(self.level)}/{int(self.config.max_level)}: "
                f"refusing new {tier.name.lower()} sessions); retry in a few seconds or use a higher tier")
