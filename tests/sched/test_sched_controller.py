from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.sched.controller import AIMDConfig, AIMDController, LatencyWindow, TierControllers
from tristream.sched.types import MS, Tier, TierSpec


def test_latency_window_percentile_and_horizon() -> None:
    w = LatencyWindow(horizon_ms=100)
    for i in range(100):
        w.add(i * MS, float(i + 1))
    assert w.percentile(99 * MS, 99) == 99.0
    assert w.percentile(99 * MS, 50) == 50.0
    w.add(200 * MS, 7.0)
    assert w.count(200 * MS) == 1  # everything older than 100 ms fell out
    w.add(200 * MS, math.inf)
    assert w.percentile(200 * MS, 99) == math.inf


def _run_plant(ctrl: TierControllers, tier: Tier, a: float, b: float, periods: int,
               rng: random.Random, start_period: int = 0) -> list[tuple[float, float]]:
    """Plant: each sample's latency = a + b * limit, with ±10% noise; 20 samples per period."""
    hist = []
    period_ns = int(ctrl.config.period_ms * MS)
    for k in range(start_period, start_period + periods):
        now = k * period_ns
        lim = ctrl.controllers[tier].limit_ms
        for j in range(20):
            ctrl.record(tier, now + j, (a + b * lim) * rng.uniform(0.9, 1.1))
        ctrl.tick(now + 20)
        hist.append((lim, ctrl.p99(tier, now + 20) or 0.0))
    return hist


@settings(max_examples=40, deadline=None)
@given(st.floats(1.0, 20.0), st.floats(0.5, 4.0), st.integers(0, 10**6))
def test_aimd_converges_below_target_without_collapsing(a: float, b: float, seed: int) -> None:
    target = 50.0
    cfg = AIMDConfig(min_limit_ms=1.0, max_limit_ms=60.0, increase_ms=0.5, decrease_factor=0.7,
                     low_water=0.6, period_ms=100.0, min_samples=5)
    ctrl = TierControllers({Tier.GOLD: TierSpec(Tier.GOLD, target)}, cfg, horizon_ms=100.0)
    hist = _run_plant(ctrl, Tier.GOLD, a, b, 300, random.Random(seed))
    ideal = (target / 1.1 - a) / b  # largest limit whose worst-case latency meets the target
    tail = hist[-100:]
    met = sum(1 for _, p in tail if p <= target) / len(tail)
    assert met >= 0.9
    # not collapsed: the limit stays within AIMD's band below the ideal limit
    lims = [lim for lim, _ in tail]
    assert min(lims) >= min(cfg.max_limit_ms, max(cfg.min_limit_ms, 0.45 * ideal))


def test_aimd_tracks_a_harder_plant() -> None:
    cfg = AIMDConfig(min_limit_ms=1.0, max_limit_ms=60.0, period_ms=100.0)
    ctrl = TierControllers({Tier.SILVER: TierSpec(Tier.SILVER, 100.0)}, cfg, horizon_ms=100.0)
    rng = random.Random(1)
    before = _run_plant(ctrl, Tier.SILVER, 10.0, 2.0, 100, rng)[-1][0]
    after = _run_plant(ctrl, Tier.SILVER, 10.0, 8.0, 100, rng, start_period=100)[-1][0]
    assert after < before
    assert (10.0 + 8.0 * after) * 1.1 <= 100.0 * 1.05


def test_aimd_holds_without_data_and_respects_bounds() -> None:
    c = AIMDController(50.0, AIMDConfig(min_limit_ms=5.0, max_limit_ms=20.0))
    assert c.update(None) == 20.0
    for _ in range(50):
        c.update(1000.0)
    assert c.limit_ms == 5.0
    for _ in range(100):
        c.update(1.0)
    assert c.limit_ms == 20.0


def test_step_budget_is_strictest_active_tier() -> None:
    ctrl = TierControllers()
    ctrl.controllers[Tier.GOLD].limit_ms = 15.0
    ctrl.controllers[Tier.BRONZE].limit_ms = 30.0
    assert ctrl.step_budget_ms({Tier.GOLD, Tier.BRONZE}) == 15.0
    assert ctrl.step_budget_ms({Tier.BRONZE}) == 30.0
    assert ctrl.step_budget_ms(set()) == ctrl.config.max_limit_ms


def test_bad_aimd_config() -> None:
    with pytest.raises(ValueError, match="decrease_factor"):
        AIMDConfig(decrease_factor=1.5)
    with pytest.raises(ValueError, match="min_limit_ms"):
        AIMDConfig(min_limit_ms=10.0, max_limit_ms=5.0)
