"""Per-tier summaries of a run: SLO attainment and response-latency percentiles."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from tristream.sched.scheduler import ServedTurn
from tristream.sched.types import DEFAULT_TIERS, Tier, TierSpec


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (nan for an empty list)."""
    v = sorted(values)
    if not v:
        return math.nan
    return v[max(1, math.ceil(q / 100.0 * len(v))) - 1]


@dataclass(frozen=True, slots=True)
class TierSummary:
    """Response latency (end of turn → first token) of one tier."""

    tier: str
    target_ms: float
    turns: int
    served: int
    shed: int
    attainment: float
    """Share of turns answered within target (shed turns count as misses)."""
    p50_ms: float
    p99_ms: float
    """Over served turns."""

    def to_dict(self) -> dict[str, float | int | str]:
        """JSON-ready dict (nan → None happens in the caller)."""
        return asdict(self)


def summarize(turns: Iterable[ServedTurn], since_ns: int = 0,
              tiers: dict[Tier, TierSpec] | None = None) -> dict[Tier, TierSummary]:
    """Summaries of turns that ended at or after `since_ns` (skips warm-up)."""
    specs = tiers or DEFAULT_TIERS
    by: dict[Tier, list[ServedTurn]] = {t: [] for t in specs}
    for r in turns:
        if r.turn_end_ns >= since_ns:
            by[r.tier].append(r)
    out: dict[Tier, TierSummary] = {}
    for t, rs in by.items():
        target = specs[t].p99_target_ms
        served = [r.latency_ms for r in rs if math.isfinite(r.latency_ms)]
        ok = sum(1 for x in served if x <= target)
        out[t] = TierSummary(t.name.lower(), target, len(rs), len(served), len(rs) - len(served),
                             ok / len(rs) if rs else math.nan, percentile(served, 50), percentile(served, 99))
    return out
