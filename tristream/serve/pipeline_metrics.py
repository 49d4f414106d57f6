"""Prometheus families of pipeline sessions: live per-stage gauges and totals over closed sessions."""

from __future__ import annotations

from typing import Any

from tristream.serve.metrics import Family
from tristream.serve.speech_stages import asr_stream_families


def stage_gauges(s: Any) -> list[Family]:
    """Per-stage latency, queue depth and drops, and the frame ring's watermark of one live
    pipeline `Session` (Prometheus families)."""
    sid = s.id
    lat: list[tuple[str, dict[str, str], float]] = []
    depth: list[tuple[str, dict[str, str], float]] = []
    drops: list[tuple[str, dict[str, str], float]] = []
    for st in s.stats()["stages"]:
        name = st["name"]
        pm = st["process_ms"]
        for q, key in (("0.5", "p50"), ("0.95", "p95"), ("0.99", "p99")):
            lat.append(("tristream_stage_process_seconds", {"session": sid, "stage": name, "quantile": q},
                        pm.get(key, 0.0) / 1e3))
        lat.append(("tristream_stage_process_seconds_count", {"session": sid, "stage": name}, pm.get("count", 0.0)))
        depth.append(("tristream_stage_queue_depth", {"session": sid, "stage": name}, float(st["queued"])))
        depth.append(("tristream_stage_queue_high_water", {"session": sid, "stage": name}, float(st["high_water"])))
        for reason, n in st["drops"].items():
            drops.append(("tristream_stage_drops_total", {"session": sid, "stage": name, "reason": reason},
                          float(n)))
    for reason, n in s.drops.snapshot().items():
        drops.append(("tristream_stage_drops_total", {"session": sid, "stage": "session", "reason": reason},
                      float(n)))
    ring = [("tristream_frame_ring_fill_ratio", {"session": sid}, float(s.frames.fill_ratio)),
            ("tristream_frame_ring_high_water", {"session": sid}, float(s.frames.high_water))]
    return [
        ("tristream_stage_process_seconds", "summary", "per-stage processing time per packet", lat),
        ("tristream_stage_queue_depth", "gauge", "packets waiting in each stage inbox (and high water)", depth),
        ("tristream_stage_drops_total", "counter", "packets dropped by stage and reason", drops),
        ("tristream_frame_ring_fill_ratio", "gauge", "camera frame ring fill (and high water)", ring),
    ]


class StageTotals:
    """Per-stage processing-time histograms and drops summed over every closed session of the process."""

    def __init__(self) -> None:
        from tristream.core.metrics import DropCounter, LatencyHistogram

        self._hist_cls = LatencyHistogram
        self.timing: dict[str, Any] = {}
        self.drops = DropCounter("stages")
        self.sessions = 0

    def add_session(self, session: Any) -> None:
        """Merge one finished session's stage timings and drops."""
        self.sessions += 1
        for st in session.stages:
            h = self.timing.get(st.name)
            if h is None:
                h = self.timing[st.name] = self._hist_cls()
            try:
                h.merge(st.timing)
            except (ValueError, AttributeError):
                continue
            for reason, n in st.inbox.drops.snapshot().items():
                self.drops.add(f"{st.name}:{reason}", n)
        for reason, n in session.drops.snapshot().items():
            self.drops.add(f"session:{reason}", n)

    def families(self) -> list[Family]:
        """Prometheus families (no session label)."""
        lat: list[tuple[str, dict[str, str], float]] = []
        for name, h in sorted(self.timing.items()):
            for q in (50.0, 95.0, 99.0):
                lat.append(("tristream_stage_closed_process_seconds", {"stage": name, "quantile": f"{q / 100:g}"},
                            h.percentile(q) / 1e9))
            lat.append(("tristream_stage_closed_process_seconds_count", {"stage": name}, float(h.count)))
        drops = [("tristream_stage_closed_drops_total", {"stage": k.split(":", 1)[0], "reason": k.split(":", 1)[1]},
                  float(v)) for k, v in self.drops.snapshot().items()]
        return [("tristream_stage_closed_process_seconds", "summary",
                 "per-stage processing time per packet over closed sessions", lat),
                ("tristream_stage_closed_drops_total", "counter", "drops by stage and reason over closed sessions",
                 drops)]


STAGE_TOTALS = StageTotals()


def pipeline_families(asr: Any) -> list[Family]:
    """What a family of CPU assistant sessions exports process-wide: the closed sessions' stage
    totals and the shared streaming recogniser's counters (`asr`)."""
    return STAGE_TOTALS.families() + asr_stream_families(asr)
