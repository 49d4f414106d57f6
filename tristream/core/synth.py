"""Deterministic synthetic multi-source recordings with known ground truth.

Each source has its own clock (offset, drift, optional reset), a fixed known latency, and a
heavy-tailed arrival jitter: a Lomax (Pareto II, alpha 1.5) delay capped at `jitter_cap_ns`,
plus rare spikes and stalls (head-of-line blocking: everything captured during a stall arrives
after it). A fraction of packets is held back until just after their successor (reordering). Used by
the tests, `tristream demo` and `bench/core.py`; the same seed always gives the same recording.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tristream.core.units import parse_unit


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """How one synthetic source samples, stamps and delivers its packets."""

    source_id: str
    modality: str
    unit: str
    ticks_per_packet: int
    samples: int = 0
    drift_ppm: float = 0.0
    latency_ns: int = 10_000_000
    origin_ticks: int = 0
    jitter_scale_ns: float = 2_000_000.0
    jitter_cap_ns: float = 20_000_000.0
    spike_prob: float = 0.005
    spike_max_ns: float = 200_000_000.0
    stall_prob: float = 0.0
    stall_max_ns: float = 300_000_000.0
    reorder_prob: float = 0.01
    reset_at_s: float | None = None
    reset_to_ticks: int = 0


@dataclass(slots=True)
class SyntheticStream:
    """One source's packets in capture order, with ground truth."""

    spec: SourceSpec
    ts: np.ndarray
    src_ns: np.ndarray
    dur_ns: np.ndarray
    arrival_ns: np.ndarray
    true_ref_ns: np.ndarray
    epoch: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.ts.size)


def _delays(rng: np.random.Generator, spec: SourceSpec, capture: np.ndarray) -> np.ndarray:
    n = capture.size
    u = rng.random(n)
    jit = np.minimum(spec.jitter_scale_ns * (u ** (-1.0 / 1.5) - 1.0), spec.jitter_cap_ns)
    spikes = (rng.random(n) < spec.spike_prob) * rng.uniform(0.1, 1.0, n) * spec.spike_max_ns
    delay = jit + spikes
    if spec.stall_prob > 0:
        starts = np.flatnonzero(rng.random(n) < spec.stall_prob)
        for i in starts:
            end = capture[i] + rng.uniform(0.2, 1.0) * spec.stall_max_ns
            blocked = (capture >= capture[i]) & (capture < end)
            delay[blocked] = np.maximum(delay[blocked], end - capture[blocked])
    return delay


def generate_stream(spec: SourceSpec, duration_s: float, seed: int, start_ns: int = 1_000_000_000) -> SyntheticStream:
    """Generate one source's packets over `duration_s` seconds of reference time."""
    rng = np.random.default_rng(seed)
    unit = parse_unit(spec.unit)
    rate = 1.0 + spec.drift_ppm * 1e-6
    ns_per_tick = 1e9 / unit.ticks_per_s
    period_ref = spec.ticks_per_packet * ns_per_tick / rate
    end_ns = start_ns + duration_s * 1e9
    reset_ns = start_ns + spec.reset_at_s * 1e9 if spec.reset_at_s is not None else end_ns
    segs = []
    for epoch, (seg_start, seg_end, origin) in enumerate(
        [(float(start_ns), min(reset_ns, end_ns), spec.origin_ticks), (reset_ns + 0.37 * period_ref, end_ns,
                                                                       spec.reset_to_ticks)]
    ):
        if seg_end <= seg_start:
            continue
        k = np.arange(int(np.ceil((seg_end - seg_start) / period_ref)), dtype=np.int64)
        t = seg_start + k * period_ref
        segs.append((origin + k * spec.ticks_per_packet, t, np.full(k.size, epoch, dtype=np.int64)))
    ts = np.concatenate([s[0] for s in segs])
    true_ref = np.concatenate([s[1] for s in segs])
    epoch_arr = np.concatenate([s[2] for s in segs])
    src_ns = unit.to_ns_array(ts)
    if spec.samples > 0:
        dur_src = (spec.samples * 1_000_000_000) // (spec.samples * unit.ticks_per_s // spec.ticks_per_packet) \
            if unit.is_sample_index else spec.ticks_per_packet * ns_per_tick
    else:
        dur_src = 0
    dur = np.full(ts.size, int(round(dur_src)), dtype=np.int64)
    capture_end = true_ref + dur / rate
    arrival = capture_end + spec.latency_ns + _delays(rng, spec, capture_end)
    swap = np.flatnonzero(rng.random(ts.size - 1) < spec.reorder_prob) if ts.size > 1 else np.array([], int)
    for i in swap:  # packet i is held back until just after its successor (never before its capture)
        arrival[i] = max(arrival[i], arrival[i + 1] + rng.uniform(1_000.0, 1_000_000.0))
    return SyntheticStream(
        spec=spec,
        ts=ts,
        src_ns=src_ns.astype(np.int64),
        dur_ns=dur,
        arrival_ns=np.rint(arrival).astype(np.int64),
        true_ref_ns=np.rint(true_ref).astype(np.int64),
        epoch=epoch_arr,
        meta={"reordered_swaps": int(swap.size)},
    )


def tri_modal_specs(reset: bool = True, spikes: bool = True, reset_at_s: float = 31.0) -> list[SourceSpec]:
    """Camera (30 fps, ns PTS) + microphone (16 kHz, 20 ms chunks, sample index, reset) + IMU (200 Hz, 10-sample blocks, µs)."""
    sp = 0.005 if spikes else 0.0
    st = 0.002 if spikes else 0.0
    return [
        SourceSpec("cam0", "video", "ns", 33_333_333, 0, drift_ppm=80.0, latency_ns=35_000_000,
                   origin_ticks=5_000_000_000_000, jitter_scale_ns=3_000_000.0, spike_prob=sp, stall_prob=st),
        SourceSpec("mic0", "audio", "samples@16000", 320, 320, drift_ppm=-50.0, latency_ns=10_000_000,
                   origin_ticks=123_456, spike_prob=sp, stall_prob=st,
                   reset_at_s=reset_at_s if reset else None, reset_to_ticks=0),
        SourceSpec("imu0", "sensor", "us", 50_000, 10, drift_ppm=120.0, latency_ns=5_000_000,
                   origin_ticks=777_000_000, jitter_scale_ns=1_000_000.0, spike_prob=sp, stall_prob=st),
    ]


def generate(specs: list[SourceSpec], duration_s: float, seed: int) -> dict[str, SyntheticStream]:
    """Generate every source (seeded per source, so adding one does not change the others)."""
    return {s.source_id: generate_stream(s, duration_s, seed * 1000 + i) for i, s in enumerate(specs)}


def arrival_order(streams: dict[str, SyntheticStream]) -> list[tuple[str, int]]:
    """(source_id, packet index) of every packet, in arrival order (ties by source, index)."""
    keys: list[tuple[int, str, int]] = []
    for sid, s in streams.items():
        keys.extend((int(a), sid, i) for i, a in enumerate(s.arrival_ns))
    keys.sort()
    return [(sid, i) for _, sid, i in keys]


def to_events(streams: dict[str, SyntheticStream]) -> list[dict[str, Any]]:
    """The recording as `tristream align` JSON events, in arrival order."""
    out: list[dict[str, Any]] = []
    for sid, i in arrival_order(streams):
        s = streams[sid]
        ev: dict[str, Any] = {
            "source": sid,
            "modality": s.spec.modality,
            "ts": int(s.ts[i]),
            "unit": s.spec.unit,
            "arrival_ns": int(s.arrival_ns[i]),
        }
        if s.spec.samples:
            ev["samples"] = s.spec.samples
            if s.spec.modality == "sensor":
                ev["rate_hz"] = s.spec.samples * 1e9 / float(s.dur_ns[i])
        out.append(ev)
    return out


def stamp_late(streams: dict[str, SyntheticStream], fraction: float, seed: int,
               lo_ns: int = 1_000_000, hi_ns: int = 9_000_000) -> dict[str, np.ndarray]:
    """Make `fraction` of packets look stamped late: they arrive 1-9 ms earlier than possible.

    Modifies `arrival_ns` in place and returns the affected packets' mask per source.
    """
    rng = np.random.default_rng(seed)
    masks = {}
    for sid, s in streams.items():
        bad = rng.random(len(s)) < fraction
        s.arrival_ns[bad] -= rng.integers(lo_ns, hi_ns, int(bad.sum()))
        masks[sid] = bad
    return masks
