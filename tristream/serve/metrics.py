"""Serving metrics and their Prometheus text exposition.

Counters are labelled (``reason``, ``code``, ``type``); latencies use the core
`LatencyHistogram` and are exposed as Prometheus summaries (P50/P95/P99 quantiles plus
``_sum``/``_count``). Backends add their own counters and gauges (stage latencies, queue
depths, ring watermarks, drops by reason) through `ServeMetrics.add_collector`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tristream.core.metrics import LatencyHistogram

Sample = tuple[str, dict[str, str], float]
Family = tuple[str, str, str, list[Sample]]
"""One metric family: name, type, help, samples (name, labels, value)."""
Collector = Callable[[], list[Family]]
# What a source clock counts (`SourceClock.counts`); these are exported even while still zero.
CLOCK_EVENTS = ("duplicate", "gap", "lost", "wrap", "reset", "outlier", "delayed", "reordered", "previous_epoch")


def fmt_value(v: float) -> str:
    """A sample value in the text format, exact: whole numbers as integers (counters past a million
    keep every digit, which ``%g`` would round to six), others as the shortest repr, infinities
    and NaN as Prometheus spells them."""
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    if v == int(v) and abs(v) < 2**53:
        return str(int(v))
    return repr(float(v))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in sorted(labels.items()))
    return "{" + inner + "}"


@dataclass(slots=True)
class ServeMetrics:
    """Process-wide serving metrics (one per server)."""

    counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    latencies: dict[str, LatencyHistogram] = field(default_factory=dict)
    collectors: list[Collector] = field(default_factory=list)
    helps: dict[str, str] = field(default_factory=dict)

    def inc(self, name: str, n: float = 1.0, **labels: str) -> None:
        """Add ``n`` to counter ``name`` with the given labels."""
        key = (name, tuple(sorted(labels.items())))
        self.counters[key] = self.counters.get(key, 0.0) + n

    def count(self, name: str, **labels: str) -> float:
        """Current value of a counter (0 if never incremented)."""
        return self.counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def set(self, name: str, value: float) -> None:
        """Set gauge ``name``."""
        self.gauges[name] = value

    def observe_ns(self, name: str, value_ns: int) -> None:
        """Record a latency (ns) into histogram ``name``."""
        h = self.latencies.get(name)
        if h is None:
            h = self.latencies[name] = LatencyHistogram()
        h.record(value_ns)

    def add_collector(self, fn: Collector) -> None:
        """Register a callable returning extra metric families at scrape time."""
        self.collectors.append(fn)

    def render(self) -> str:
        """The Prometheus text format (version 0.0.4)."""
        lines: list[str] = []
        by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        for (name, labels), v in sorted(self.counters.items()):
            by_name.setdefault(name, []).append((dict(labels), v))
        for name, csamples in by_name.items():
            lines.append(f"# HELP {name} {self.helps.get(name, name.replace('_', ' '))}")
            lines.append(f"# TYPE {name} counter")
            lines.extend(f"{name}{_labels(lab)} {fmt_value(v)}" for lab, v in csamples)
        for name, v in sorted(self.gauges.items()):
            lines.append(f"# HELP {name} {self.helps.get(name, name.replace('_', ' '))}")
            lines.append(f"# TYPE {name} gauge")
            lines.append(f"{name} {fmt_value(v)}")
        for name, h in sorted(self.latencies.items()):
            lines.append(f"# HELP {name} {self.helps.get(name, name.replace('_', ' '))} (seconds)")
            lines.append(f"# TYPE {name} summary")
            for q in (50.0, 95.0, 99.0):
                lines.append(f'{name}{{quantile="{q / 100:g}"}} {h.percentile(q) / 1e9:.6f}')
            lines.append(f"{name}_sum {h.sum / 1e9:.6f}")
            lines.append(f"{name}_count {h.count}")
        merged: dict[str, tuple[str, str, list[Sample]]] = {}
        for name, typ, help_, samples in [fam for fn in self.collectors for fam in fn()] + _gpu_memory():
            if name in merged:  # one HELP/TYPE per family even when many sessions report it
                merged[name][2].extend(samples)
            else:
                merged[name] = (typ, help_, list(samples))
        for name, (typ, help_, samples) in merged.items():
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {typ}")
            lines.extend(f"{n}{_labels(lab)} {fmt_value(v)}" for n, lab, v in samples)
        return "\n".join(lines) + "\n"


def _gpu_memory() -> list[tuple[str, str, str, list[Sample]]]:
    """GPU memory gauges when torch is already loaded and sees a CUDA device (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return []
    n = torch.cuda.device_count()
    alloc: list[Sample] = [("tristream_gpu_memory_allocated_bytes", {"device": str(i)},
                            float(torch.cuda.memory_allocated(i))) for i in range(n)]
    reserved: list[Sample] = [("tristream_gpu_memory_reserved_bytes", {"device": str(i)},
                               float(torch.cuda.memory_reserved(i))) for i in range(n)]
    return [("tristream_gpu_memory_allocated_bytes", "gauge", "GPU memory allocated by torch", alloc),
            ("tristream_gpu_memory_reserved_bytes", "gauge", "GPU memory reserved by torch", reserved)]


def clock_families(clocks: Mapping[str, Any], **labels: str) -> list[tuple[str, str, str, list[Sample]]]:
    """Prometheus families of source clocks (`tristream.core.clock.SourceClock`, keyed by source):
    every duplicate, gap, lost packet, wrap and reset (and the other clock events) counted per
    source, the holes not yet confirmed as gaps, drift, uncertainty and epoch. `labels` (e.g.
    ``session=...``) go on every sample, so many sessions' clocks can share one scrape."""
    events: list[Sample] = []
    open_gaps: list[Sample] = []
    drift: list[Sample] = []
    unc: list[Sample] = []
    epoch: list[Sample] = []
    for source, clock in sorted(clocks.items()):
        lab = {**labels, "source": source}
        counts = clock.counts.snapshot()
        for ev in (*CLOCK_EVENTS, *sorted(set(counts) - set(CLOCK_EVENTS))):
            events.append(("tristream_clock_events_total", {**lab, "event": ev}, float(counts.get(ev, 0))))
        open_gaps.append(("tristream_clock_open_gaps", lab, float(clock.open_gaps)))
        drift.append(("tristream_clock_drift_ppm", lab, float(clock.drift_ppm)))
        u = clock.uncertainty_ns
        unc.append(("tristream_clock_uncertainty_seconds", lab, u / 1e9 if u != float("inf") else -1.0))
        epoch.append(("tristream_clock_epoch", lab, float(clock.epoch)))
    return [
        ("tristream_clock_events_total", "counter",
         "source clock events by source: duplicates, gaps, lost packets, wraps, resets, outliers, ...", events),
        ("tristream_clock_open_gaps", "gauge", "holes in a source's timeline not yet confirmed as gaps", open_gaps),
        ("tristream_clock_drift_ppm", "gauge", "how fast a source clock runs against the reference (ppm)", drift),
        ("tristream_clock_uncertainty_seconds", "gauge",
         "bound on the newest mapping's error (-1 before the first packet)", unc),
        ("tristream_clock_epoch", "gauge", "current epoch of a source clock (resets so far)", epoch),
    ]
