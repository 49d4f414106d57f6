"""A family of synthetic capture chains whose clocks wander, wrap, lose packets and sit behind congested links.

`generate_family(faults, seed, duration_s)` builds a camera + microphone + IMU recording with
known ground truth, every number drawn from `seed`:

- `drift`: each crystal's rate is a base of +-150 ppm plus a slow temperature swing of 10-40 ppm
  (period 1-5 min, random phase) and one or two steps in rate of 2-15 ppm;
  without it the rate is the base alone.
- `wrap`: 32-bit RTP video (90 kHz) or 33-bit MPEG-TS PTS, 32-bit RTP audio (48 kHz), each
  starting so close to the wrap that it wraps mid-recording.
- `loss`: bursts of lost audio chunks (the sample index jumps), single dropped frames, packets
  duplicated (the copy arrives 0.1-300 ms later) and the IMU silent for 10-40 s.
- `network`: heavy-tailed (Lomax) jitter, spikes of 10-120 ms, congestion episodes whose
  queueing delay ramps up by 10-60 ms over seconds and drains (camera and microphone share a
  link), and packets held back behind their successor (arrival order scrambled).
- `reset`: one source's timestamps restart at 0, another's device is replugged with a new
  origin after a short silence.

The clock model: a source captures packet k at source elapsed time k * period; its reference
time is the inverse of S(t) = integral of (1 + rate(t)), so drift swings bend the map exactly
as a real oscillator does. Packets arrive at capture end + known latency + delay (delay >= 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tristream.core.synth import SourceSpec, SyntheticStream
from tristream.core.units import parse_unit

FAULTS = ("drift", "wrap", "loss", "network", "reset")


@dataclass(frozen=True, slots=True)
class RateModel:
    """A crystal's fractional rate error over reference seconds: base + swing + steps."""

    base: float
    swing: float = 0.0
    period_s: float = 120.0
    phase: float = 0.0
    step_at_s: tuple[float, ...] = ()
    step: tuple[float, ...] = ()

    def rate(self, t: np.ndarray) -> np.ndarray:
        """Fractional rate error (1e-6 = 1 ppm fast) at reference seconds `t`."""
        r = self.base + self.swing * np.sin(2 * math.pi * t / self.period_s + self.phase)
        for at, d in zip(self.step_at_s, self.step, strict=True):
            r = r + d * (t >= at)
        return np.asarray(r, dtype=np.float64)

    def elapsed(self, t: np.ndarray) -> np.ndarray:
        """Source seconds elapsed at reference seconds `t` (S(t) = integral of 1 + rate)."""
        w = 2 * math.pi / self.period_s
        s = t * (1.0 + self.base)
        if self.swing:
            s = s + self.swing / w * (math.cos(self.phase) - np.cos(w * t + self.phase))
        for at, d in zip(self.step_at_s, self.step, strict=True):
            s = s + d * np.maximum(t - at, 0.0)
        return np.asarray(s, dtype=np.float64)


def _rate_model(rng: np.random.Generator, drift: bool, duration_s: float) -> RateModel:
    base = rng.uniform(-150e-6, 150e-6)
    if not drift:
        return RateModel(base)
    n_steps = int(rng.integers(1, 3))
    at = tuple(sorted(float(x) for x in rng.uniform(0.1, 0.9, n_steps) * duration_s))
    step = tuple(float(rng.choice([-1, 1]) * rng.uniform(2e-6, 15e-6)) for _ in range(n_steps))
    return RateModel(base, rng.uniform(10e-6, 40e-6), rng.uniform(60.0, 300.0), rng.uniform(0, 2 * math.pi), at, step)


def _episodes(rng: np.random.Generator, duration_s: float, per_min: float) -> list[tuple[float, float, float, float, float]]:
    """Congestion episodes: (start, ramp, hold, drain, peak) in seconds, the peak in ns."""
    n = int(rng.poisson(per_min * duration_s / 60.0))
    out = []
    for t in np.sort(rng.uniform(5.0, duration_s, n)):
        out.append((float(t), rng.uniform(1.0, 5.0), rng.uniform(0.0, 3.0), rng.uniform(0.5, 3.0),
                    rng.uniform(10e6, 60e6)))
    return out


def _queueing(t: np.ndarray, episodes: list[tuple[float, float, float, float, float]]) -> np.ndarray:
    q = np.zeros_like(t)
    for t0, ramp, hold, drain, peak in episodes:
        up = np.clip((t - t0) / ramp, 0.0, 1.0)
        down = np.clip(1.0 - (t - t0 - ramp - hold) / drain, 0.0, 1.0)
        q = np.maximum(q, peak * np.minimum(up, down) * (t >= t0))
    return q


@dataclass(slots=True)
class _Source:
    sid: str
    modality: str
    unit: str
    ticks: int  # per packet
    samples: int
    latency_ns: int


def _sources(rng: np.random.Generator, wrap: bool) -> list[_Source]:
    fps = float(rng.choice([25.0, 30.0, 30000 / 1001]))
    if wrap:
        cam_unit = str(rng.choice(["rtp@90000", "pts90k"]))
        cam = _Source("cam0", "video", cam_unit, round(90_000 / fps), 0, 0)
        chunk_ms = int(rng.choice([10, 20]))
        mic = _Source("mic0", "audio", "rtp@48000", 48 * chunk_ms, 48 * chunk_ms, 0)
    else:
        cam = _Source("cam0", "video", "ns", round(1e9 / fps), 0, 0)
        rate = int(rng.choice([16_000, 48_000]))
        n = rate // 50
        mic = _Source("mic0", "audio", f"samples@{rate}", n, n, 0)
    imu_rate = int(rng.choice([100, 200, 400]))
    block = int(rng.choice([4, 8, 10, 20]))
    imu = _Source("imu0", "sensor", "us", round(block * 1e6 / imu_rate), block, 0)
    out = [cam, mic, imu]
    for s in out:
        s.latency_ns = int(rng.uniform(2e6, 50e6))
    return out


def generate_family(faults: Iterable[str] | str, seed: int, duration_s: float = 300.0,
                    start_ns: int = 1_000_000_000) -> dict[str, SyntheticStream]:
    """A camera + microphone + IMU recording with the given faults (`"all"` for every one).

    Ground truth per stream: `true_ref_ns`, `epoch`, and in `meta`: `duplicate` (mask of the
    copies), `truth` (wraps, resets, duplicates, gaps, lost packets) and the parameters drawn.
    """
    fs = set(FAULTS) if faults == "all" else {faults} if isinstance(faults, str) else set(faults)
    unknown = fs - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; expected a subset of {FAULTS} or 'all'")
    rng = np.random.default_rng([seed, 25])
    srcs = _sources(rng, "wrap" in fs)
    shared_link = _episodes(rng, duration_s, rng.uniform(0.5, 2.0)) if "network" in fs else []
    resets: dict[str, list[tuple[float, str]]] = {s.sid: [] for s in srcs}
    if "reset" in fs:
        a, b = rng.choice(len(srcs), 2, replace=False)
        resets[srcs[int(a)].sid].append((rng.uniform(0.2, 0.45) * duration_s, "restart"))
        resets[srcs[int(b)].sid].append((rng.uniform(0.55, 0.8) * duration_s, "replug"))
    out = {}
    for i, src in enumerate(srcs):
        r = np.random.default_rng([seed, 25, i])
        link = shared_link if src.sid != "imu0" else (
            _episodes(r, duration_s, r.uniform(0.5, 2.0)) if "network" in fs else [])
        out[src.sid] = _stream(src, fs, r, duration_s, start_ns, link, sorted(resets[src.sid]))
    return out


def _stream(src: _Source, fs: set[str], rng: np.random.Generator, duration_s: float, start_ns: int,
            link: list[tuple[float, float, float, float, float]], resets: list[tuple[float, str]]) -> SyntheticStream:
    unit = parse_unit(src.unit)
    tps = unit.ticks_per_s
    wrap_ticks = 1 << unit.wrap_bits if unit.wrap_bits else 0
    model = _rate_model(rng, "drift" in fs, duration_s)
    grid = np.linspace(0.0, duration_s + 5.0, int((duration_s + 5.0) * 100) + 2)
    el = model.elapsed(grid)
    period_s = src.ticks / tps
    # Epochs: (reference start s, tick origin)
    if wrap_ticks:
        origin = wrap_ticks - int(rng.uniform(0.15, 0.85) * duration_s * tps)
    else:
        origin = int(rng.integers(0, 10**6)) * src.ticks + int(rng.integers(0, 2**40 if unit.ticks_per_s >= 10**6 else 2**28))
    epochs = [(rng.uniform(0.0, period_s), origin)]
    for at, kind in resets:
        if kind == "restart":
            epochs.append((at, int(rng.integers(0, 5)) * src.ticks))
        else:  # replugged: silent a moment, then a new arbitrary origin
            new = int(rng.integers(0, wrap_ticks if wrap_ticks else (2**40 if tps >= 10**6 else 2**31)))
            epochs.append((at + rng.uniform(0.3, 3.0), new))
    ts_l, t_l, ep_l, k_l = [], [], [], []
    for e, (t0, org) in enumerate(epochs):
        t1 = epochs[e + 1][0] if e + 1 < len(epochs) else duration_s
        e0 = float(np.interp(t0, grid, el))
        e1 = float(np.interp(t1, grid, el))
        k = np.arange(int(max(0.0, e1 - e0) / period_s), dtype=np.int64)
        t = np.interp(e0 + k * period_s, el, grid)
        ticks = org + k * src.ticks
        ts_l.append(ticks)
        t_l.append(t)
        ep_l.append(np.full(k.size, e, np.int64))
        k_l.append(k)
    ticks = np.concatenate(ts_l)
    t_cap = np.concatenate(t_l)
    epoch = np.concatenate(ep_l)
    kidx = np.concatenate(k_l)
    keep = np.ones(ticks.size, bool)
    truth = {"resets": len(epochs) - 1}
    if "loss" in fs:
        n = ticks.size
        if src.modality == "audio":
            nb = int(rng.poisson(rng.uniform(1.0, 4.0) * duration_s / 60.0))
            for s0 in rng.integers(0, n, nb):
                keep[s0 : s0 + int(rng.integers(1, 26))] = False
        elif src.modality == "video":
            keep &= rng.random(n) >= rng.uniform(0.001, 0.005)
        else:
            s0 = rng.uniform(0.1, 0.7) * duration_s
            keep &= ~((t_cap >= s0) & (t_cap < s0 + rng.uniform(10.0, 40.0)))
        keep[0] = True
    dur_ticks = src.ticks if src.samples else 0
    t_end = np.interp(np.interp(t_cap, grid, el) + dur_ticks / tps, el, grid)
    ticks, t_cap, t_end, epoch, kidx = ticks[keep], t_cap[keep], t_end[keep], epoch[keep], kidx[keep]
    truth["resets"] = max(0, int(np.unique(epoch).size) - 1)  # a reset inside a silence leaves no trace
    gaps = lost = 0
    for e in range(len(epochs)):
        dk = np.diff(kidx[epoch == e])
        gaps += int(np.sum(dk > 1))
        lost += int(np.sum(dk[dk > 1] - 1))
    truth.update(gaps=gaps, lost=lost)
    wraps = 0
    if wrap_ticks:
        for e in range(len(epochs)):
            te = ticks[epoch == e]
            if te.size:
                wraps += int(te[-1] // wrap_ticks - te[0] // wrap_ticks)
        ticks = ticks % wrap_ticks
    truth["wraps"] = wraps
    n = ticks.size
    # Network: delay = jitter + spikes + congestion (queueing of the link at send time).
    if "network" in fs:
        scale, cap = rng.uniform(0.5e6, 4e6), rng.uniform(15e6, 40e6)
        delay = np.minimum(scale * (rng.random(n) ** (-1.0 / 1.5) - 1.0), cap)
        spikes = rng.random(n) < rng.uniform(0.002, 0.01)
        delay[spikes] += rng.uniform(10e6, 120e6, int(spikes.sum()))
        delay += _queueing(t_end, link)
        reorder_p = rng.uniform(0.002, 0.02)
    else:
        scale = rng.uniform(0.2e6, 1e6)
        delay = np.minimum(scale * (rng.random(n) ** (-1.0 / 1.5) - 1.0), 5e6)
        reorder_p = 0.0
    true_ref = start_ns + t_cap * 1e9
    arrival = start_ns + t_end * 1e9 + src.latency_ns + delay
    if reorder_p:
        for i in np.flatnonzero(rng.random(n - 1) < reorder_p):
            arrival[i] = max(arrival[i], arrival[i + 1] + rng.uniform(1e3, 1e6))
    dup = np.zeros(n, bool)
    if "loss" in fs:
        copies = np.flatnonzero(rng.random(n) < rng.uniform(0.002, 0.01))
        idx = np.concatenate([np.arange(n), copies])
        dup = np.concatenate([dup, np.ones(copies.size, bool)])
        arrival = np.concatenate([arrival, arrival[copies] + rng.uniform(0.1e6, 300e6, copies.size)])
        ticks, true_ref, epoch, t_end = ticks[idx], true_ref[idx], epoch[idx], t_end[idx]
        order = np.argsort(true_ref, kind="stable")
        ticks, true_ref, epoch, dup, arrival = ticks[order], true_ref[order], epoch[order], dup[order], arrival[order]
    truth["duplicates"] = int(dup.sum())
    n = ticks.size
    dur_ns = unit.to_ns(dur_ticks) if dur_ticks else 0
    spec = SourceSpec(src.sid, src.modality, src.unit, src.ticks, src.samples, drift_ppm=model.base * 1e6,
                      latency_ns=src.latency_ns)
    meta = {"duplicate": dup, "truth": truth, "faults": sorted(fs), "rate_model": model,
            "resets": [(round(a, 3), k) for a, k in resets], "jitter_scale_ns": scale}
    return SyntheticStream(spec=spec, ts=ticks.astype(np.int64), src_ns=unit.to_ns_array(ticks).astype(np.int64),
                           dur_ns=np.full(n, dur_ns, np.int64), arrival_ns=np.rint(arrival).astype(np.int64),
                           true_ref_ns=np.rint(true_ref).astype(np.int64), epoch=epoch, meta=meta)
