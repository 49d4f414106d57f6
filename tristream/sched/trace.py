"""Synthetic, seeded load traces: N concurrent tri-modal sessions.

Each session has an SLA tier, a 30 fps camera, and a conversation: the user speaks for a
while (speech_start … turn_end), waits, speaks again; some turns are typed messages
instead. Sessions have finite lifetimes and are replaced by new ones (churn), so admission
of *new* sessions matters under overload. The trace is open-loop (it does not wait for
answers; a user who speaks over an answer interrupts it, as in real conversations).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum

from tristream.sched.types import Tier


class EventKind(StrEnum):
    """Kinds of trace events."""

    OPEN = "open"
    CLOSE = "close"
    SPEECH_START = "speech_start"
    TURN_END = "turn_end"
    TEXT = "text"


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One input event; `tokens` = prompt tail or message length, `answer` = answer length."""

    t_ns: int
    session_id: int
    kind: EventKind
    tier: Tier = Tier.BRONZE
    tokens: int = 0
    answer: int = 0
    camera_fps: float = 30.0


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Shape of the synthetic load."""

    sessions: int = 64
    """Concurrent sessions (each slot is refilled when its session ends)."""
    duration_s: float = 20.0
    seed: int = 0
    tier_mix: tuple[float, float, float] = (0.2, 0.3, 0.5)
    speak_s: tuple[float, float] = (1.0, 3.0)
    gap_s: tuple[float, float] = (2.0, 6.0)
    text_turn_prob: float = 0.15
    tail_tokens: tuple[int, int] = (8, 24)
    text_tokens: tuple[int, int] = (10, 40)
    answer_tokens: tuple[int, int] = (20, 80)
    camera_fps: float = 30.0
    lifetime_s: tuple[float, float] | None = (10.0, 40.0)
    """None: sessions live for the whole trace (no churn)."""
    start_spread_s: float = 1.0

    def __post_init__(self) -> None:
        if self.sessions < 0 or self.duration_s <= 0:
            raise ValueError(f"need sessions >= 0 and duration_s > 0, got {self.sessions}, {self.duration_s}")
        if abs(sum(self.tier_mix) - 1.0) > 1e-6 or min(self.tier_mix) < 0:
            raise ValueError(f"tier_mix must be 3 non-negative shares summing to 1, got {self.tier_mix}")


def _ns(s: float) -> int:
    return int(round(s * 1e9))


def generate_trace(cfg: TraceConfig) -> list[TraceEvent]:
    """All events of the trace, sorted by time (ties keep generation order)."""
    rng = random.Random(cfg.seed)
    end = cfg.duration_s
    events: list[tuple[int, int, TraceEvent]] = []
    seq = 0
    next_sid = 0

    def emit(ev: TraceEvent) -> None:
        nonlocal seq
        seq += 1
        events.append((ev.t_ns, seq, ev))

    for _slot in range(cfg.sessions):
        start = rng.uniform(0.0, cfg.start_spread_s)
        while start < end:
            sid = next_sid
            next_sid += 1
            tier = Tier(rng.choices(range(3), weights=cfg.tier_mix)[0])
            life = rng.uniform(*cfg.lifetime_s) if cfg.lifetime_s else end
            stop = min(end, start + life)
            emit(TraceEvent(_ns(start), sid, EventKind.OPEN, tier, camera_fps=cfg.camera_fps))
            t = start + rng.uniform(0.0, cfg.gap_s[1])
            while t < stop:
                if rng.random() < cfg.text_turn_prob:
                    emit(TraceEvent(_ns(t), sid, EventKind.TEXT, tier, rng.randint(*cfg.text_tokens),
                                    rng.randint(*cfg.answer_tokens)))
                    t += rng.uniform(*cfg.gap_s)
                    continue
                t_end = t + rng.uniform(*cfg.speak_s)
                if t_end >= stop:
                    break
                emit(TraceEvent(_ns(t), sid, EventKind.SPEECH_START, tier))
                emit(TraceEvent(_ns(t_end), sid, EventKind.TURN_END, tier, rng.randint(*cfg.tail_tokens),
                                rng.randint(*cfg.answer_tokens)))
                t = t_end + rng.uniform(*cfg.gap_s)
            emit(TraceEvent(_ns(stop), sid, EventKind.CLOSE, tier))
            if cfg.lifetime_s is None:
                break
            start = stop + rng.uniform(0.0, 0.5)
    events.sort(key=lambda e: (e[0], e[1]))
    return [e[2] for e in events]
