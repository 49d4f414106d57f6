"""Python garbage-collector pauses: measured, exported, and made short in serving processes.

A full (generation-2) collection walks every tracked container object in the process. A serving
process holds hundreds of thousands of them once torch, transformers, Ray and a model are loaded
(225k right after the imports; a collection of those takes ~60 ms on a server core), and every
thread stops while it runs (the GIL is held) — engine loop, event loop and sockets alike. With a
few hundred sessions each turn's latency budget is tens of milliseconds, so an unlucky
collection shows up as a P99 spike on every answer in flight.

`settle_heap` collects once and then `gc.freeze()`s whatever survives — the start-up heap (modules,
model modules, captured graphs' Python objects). Frozen objects are never scanned again, so later
collections walk only what serving created (sessions, events). Call it once per process, after the
models are loaded and warmed: objects alive at that moment that later become cyclic garbage are
never reclaimed (acyclic ones still are, by reference counting). `tristream serve` and each Ray
engine replica do this; ``TRISTREAM_GC_FREEZE=0`` turns it off.

`GcPauses` times every collection through `gc.callbacks` and exports, per generation, the count,
the total seconds and the longest pause, plus the longest pause of the last minute — the figure to
put beside a latency P99 (`bench/scale.py` records it per load level).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections import deque
from typing import Any

RECENT_S = 60.0  # window of `max_recent_s`
_RECENT_MIN_S = 1e-3  # pauses shorter than this are not kept for the window (counted all the same)

Family = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]


class GcPauses:
    """Times garbage collections (see the module docstring). One per process: `gc_pauses()`."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self._clock = clock
        self._t0: float | None = None
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self._recent: deque[tuple[float, float, int]] = deque(maxlen=4096)  # (end, seconds, generation)
        self._lock = threading.Lock()

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = self._clock()
            return
        if self._t0 is None:  # installed in the middle of a collection
            return
        now = self._clock()
        dur = now - self._t0
        self._t0 = None
        g = min(2, max(0, int(info.get("generation", 0))))
        with self._lock:
            self.count[g] += 1
            self.total_s[g] += dur
            self.max_s[g] = max(self.max_s[g], dur)
            if dur >= _RECENT_MIN_S:
                self._recent.append((now, dur, g))

    def install(self) -> GcPauses:
        """Start timing (idempotent)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        """Stop timing (tests)."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def max_recent_s(self, window_s: float = RECENT_S) -> float:
        """The longest pause (≥ 1 ms) that ended within the last ``window_s`` seconds; 0.0 if none."""
        cutoff = self._clock() - window_s
        with self._lock:
            return max((d for t, d, _ in self._recent if t >= cutoff), default=0.0)

    def snapshot(self) -> dict[str, Any]:
        """Plain-data view: per generation count / total / max seconds, and the last minute's max."""
        with self._lock:
            out: dict[str, Any] = {f"gen{g}": {"count": self.count[g], "total_s": round(self.total_s[g], 6),
                                               "max_s": round(self.max_s[g], 6)} for g in range(3)}
        out["max_recent_s"] = round(self.max_recent_s(), 6)
        out["frozen_objects"] = gc.get_freeze_count()
        return out

    def collect(self) -> list[Family]:
        """Prometheus families for `ServeMetrics.add_collector`."""
        with self._lock:
            counts = [("tristream_gc_collections_total", {"generation": str(g)}, float(self.count[g]))
                      for g in range(3)]
            totals = [("tristream_gc_pause_seconds_total", {"generation": str(g)}, self.total_s[g]) for g in range(3)]
            maxes = [("tristream_gc_pause_max_seconds", {"generation": str(g)}, self.max_s[g]) for g in range(3)]
        return [
            ("tristream_gc_collections_total", "counter", "garbage collections by generation", counts),
            ("tristream_gc_pause_seconds_total", "counter", "seconds spent in garbage collection", totals),
            ("tristream_gc_pause_max_seconds", "gauge", "longest garbage-collection pause since start", maxes),
            ("tristream_gc_pause_max_recent_seconds", "gauge",
             f"longest garbage-collection pause in the last {RECENT_S:g} s",
             [("tristream_gc_pause_max_recent_seconds", {}, self.max_recent_s())]),
            ("tristream_gc_frozen_objects", "gauge", "objects moved out of collection by gc.freeze()",
             [("tristream_gc_frozen_objects", {}, float(gc.get_freeze_count()))]),
        ]


_PAUSES: GcPauses | None = None
_PAUSES_LOCK = threading.Lock()


def gc_pauses() -> GcPauses:
    """The process's `GcPauses`, installed on first use."""
    global _PAUSES
    with _PAUSES_LOCK:
        if _PAUSES is None:
            _PAUSES = GcPauses().install()
        return _PAUSES


def settle_heap() -> int:
    """Collect, then freeze the surviving heap (see the module docstring). Returns the number of
    frozen objects (0 when ``TRISTREAM_GC_FREEZE=0``). Safe to call again: later calls freeze what
    was created since."""
    if os.environ.get("TRISTREAM_GC_FREEZE", "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
