"""Replica count from the replicas' load signal, within configured bounds.

Like Ray Serve's own autoscaler (desired = current × observed / target, with upscale and
downscale delays), but on tristream's signal: each replica's pressure is the max of its
queue depth over target and its response P99 over target (`LoadReport.pressure`). The
fleet's pressure is the mean over replicas. Sustained pressure above ``upscale_at`` for
``upscale_delay_s`` grows the fleet to ``ceil(n × pressure)`` (at least n + 1); sustained
pressure below ``downscale_below`` for ``downscale_delay_s`` removes one replica. Time is
passed in, so tests run on a virtual clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tristream.scale.load import LoadReport


class AutoscaleConfigError(ValueError):
    """Bounds or thresholds that cannot work together."""


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """Bounds and thresholds; ``min_replicas == max_replicas`` turns autoscaling off."""

    min_replicas: int = 1
    max_replicas: int = 1
    upscale_at: float = 1.0
    downscale_below: float = 0.4
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise AutoscaleConfigError(f"need 1 <= min_replicas <= max_replicas; got min={self.min_replicas}, "
                                       f"max={self.max_replicas}")
        if not 0 <= self.downscale_below < self.upscale_at:
            raise AutoscaleConfigError(f"need 0 <= downscale_below < upscale_at; got {self.downscale_below} "
                                       f"and {self.upscale_at}")


class Autoscaler:
    """Decides the desired replica count; see the module docstring."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._over_since: float | None = None
        self._under_since: float | None = None
        self.last_pressure = 0.0

    def desired(self, reports: Sequence[LoadReport], now_s: float) -> int:
        """Desired number of replicas given the live replicas' reports at ``now_s``."""
        cfg = self.config
        n = len(reports)
        if n < cfg.min_replicas:
            self._over_since = self._under_since = None
            return cfg.min_replicas
        pressure = sum(min(r.pressure, 10.0) for r in reports) / n
        self.last_pressure = pressure
        want = n
        if pressure > cfg.upscale_at:
            self._under_since = None
            if self._over_since is None:
                self._over_since = now_s
            if now_s - self._over_since >= cfg.upscale_delay_s:
                want = max(n + 1, math.ceil(n * pressure / cfg.upscale_at))
                self._over_since = None
        elif pressure < cfg.downscale_below:
            self._over_since = None
            if self._under_since is None:
                self._under_since = now_s
            if now_s - self._under_since >= cfg.downscale_delay_s:
                want = n - 1
                self._under_since = None
        else:
            self._over_since = self._under_since = None
        return max(cfg.min_replicas, min(cfg.max_replicas, want))
