"""Feedback control of the batch limit: one AIMD controller per SLA tier.

The batch limit is a *step budget* in modelled milliseconds (the batcher stops adding work
to a step once the step-time model says the step would exceed it); it is the knob that
trades throughput (big steps amortise fixed costs) against the latency of urgent work
(which waits for the step in flight and then runs in a step of its own size). Each tier's
controller watches that tier's measured response-latency P99 over a sliding window:
above target → multiplicative decrease, below `low_water * target` → additive increase,
in between → hold. The step budget in force is the minimum over tiers that have an end of
turn waiting (the strictest wins); a step that carries no first token runs at full size, so
a tier missing its target because of queueing (overload) cannot shrink every step and
collapse throughput — overload is the degradation ladder's job.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from tristream.sched.types import DEFAULT_TIERS, MS, Tier, TierSpec


class LatencyWindow:
    """Latency samples of the last `horizon_ms`; misses (shed turns) count as +inf."""

    def __init__(self, horizon_ms: float = 2000.0, max_samples: int = 4096) -> None:
        self._horizon_ns = int(horizon_ms * MS)
        self._samples: deque[tuple[int, float]] = deque(maxlen=max_samples)

    def add(self, now_ns: int, latency_ms: float) -> None:
        """Record one latency (use math.inf for a shed or refused turn)."""
        self._samples.append((now_ns, latency_ms))

    def _trim(self, now_ns: int) -> None:
        cut = now_ns - self._horizon_ns
        while self._samples and self._samples[0][0] < cut:
            self._samples.popleft()

    def count(self, now_ns: int) -> int:
        """Samples inside the window."""
        self._trim(now_ns)
        return len(self._samples)

    def mean(self, now_ns: int) -> float | None:
        """Mean of the window's samples, None when empty (also used for other per-turn values:
        `tristream.scale.load` keeps the sessions a replica held at each turn)."""
        self._trim(now_ns)
        if not self._samples:
            return None
        return sum(v for _, v in self._samples) / len(self._samples)

    def percentile(self, now_ns: int, q: float = 99.0) -> float | None:
        """Nearest-rank percentile of the window, None when empty."""
        self._trim(now_ns)
        if not self._samples:
            return None
        vals = sorted(v for _, v in self._samples)
        rank = max(1, math.ceil(q / 100.0 * len(vals)))
        return vals[rank - 1]


@dataclass(frozen=True, slots=True)
class AIMDConfig:
    """AIMD parameters; limits are step budgets in ms."""

    min_limit_ms: float = 14.0
    """Below the sum of the per-component fixed costs a step can no longer carry speech, vision
    and LLM work together and throughput collapses; keep the floor above it."""
    max_limit_ms: float = 40.0
    increase_ms: float = 1.0
    decrease_factor: float = 0.7
    low_water: float = 0.6
    period_ms: float = 100.0
    min_samples: int = 5

    def __post_init__(self) -> None:
        if not 0.0 < self.decrease_factor < 1.0:
            raise ValueError(f"decrease_factor must be in (0, 1), got {self.decrease_factor}")
        if not 0.0 < self.min_limit_ms <= self.max_limit_ms:
            raise ValueError(f"need 0 < min_limit_ms <= max_limit_ms, got {self.min_limit_ms}, {self.max_limit_ms}")
        if not 0.0 < self.low_water < 1.0:
            raise ValueError(f"low_water must be in (0, 1), got {self.low_water}")


class AIMDController:
    """Additive-increase / multiplicative-decrease of one limit against one P99 target."""

    def __init__(self, target_ms: float, config: AIMDConfig | None = None) -> None:
        self.config = config or AIMDConfig()
        self.target_ms = target_ms
        self.limit_ms = self.config.max_limit_ms
        self.decreases = 0
        self.increases = 0

    def update(self, p99_ms: float | None) -> float:
        """Feed one P99 measurement (None = no data: hold); returns the new limit."""
        c = self.config
        if p99_ms is None:
            return self.limit_ms
        if p99_ms > self.target_ms:
            self.limit_ms = max(c.min_limit_ms, self.limit_ms * c.decrease_factor)
            self.decreases += 1
        elif p99_ms < c.low_water * self.target_ms:
            self.limit_ms = min(c.max_limit_ms, self.limit_ms + c.increase_ms)
            self.increases += 1
        return self.limit_ms


class TierControllers:
    """One latency window and one AIMD controller per tier, updated once per period."""

    def __init__(self, tiers: dict[Tier, TierSpec] | None = None, config: AIMDConfig | None = None,
                 horizon_ms: float = 2000.0) -> None:
        self.tiers = dict(tiers or DEFAULT_TIERS)
        self.config = config or AIMDConfig()
        self.windows = {t: LatencyWindow(horizon_ms) for t in self.tiers}
        self.controllers = {t: AIMDController(s.p99_target_ms, self.config) for t, s in self.tiers.items()}
        self._next_update_ns = 0
        self.history: list[tuple[int, dict[Tier, float]]] = []

    def record(self, tier: Tier, now_ns: int, latency_ms: float) -> None:
        """Record one response latency (math.inf for a missed turn) of `tier`."""
        self.windows[tier].add(now_ns, latency_ms)

    def p99(self, tier: Tier, now_ns: int) -> float | None:
        """Windowed P99 of `tier` (None if too few samples)."""
        w = self.windows[tier]
        if w.count(now_ns) < self.config.min_samples:
            return None
        return w.percentile(now_ns, 99.0)

    def pressure(self, tier: Tier, now_ns: int) -> float | None:
        """P99 / target of `tier` (> 1 means the tier misses its SLO)."""
        p = self.p99(tier, now_ns)
        return None if p is None else p / self.tiers[tier].p99_target_ms

    def tick(self, now_ns: int) -> None:
        """Run the controllers if a period has elapsed."""
        if now_ns < self._next_update_ns:
            return
        self._next_update_ns = now_ns + int(self.config.period_ms * MS)
        for t, c in self.controllers.items():
            c.update(self.p99(t, now_ns))
        self.history.append((now_ns, {t: c.limit_ms for t, c in self.controllers.items()}))

    def step_budget_ms(self, active: set[Tier]) -> float:
        """Budget in force: the strictest limit among `active` tiers (max when none)."""
        lims = [self.controllers[t].limit_ms for t in active if t in self.controllers]
        return min(lims) if lims else self.config.max_limit_ms
