"""`SourceClock`: maps one source's timestamps onto the reference clock (monotonic ns).

Model: a packet captured at source time `s` (ns of the source clock) was captured at reference
time `ref = a0 + c + (1 + d) * (s - s0)` and arrived at `ref + latency + delay`, delay >= 0.
The fit runs along the lower envelope of (s, arrival) - the minimum-delay line - so heavy-tailed
jitter, spikes, congestion and reordering only ever sit above it.

Online and bounded: each epoch keeps, per window of `window_ns` source time, its few points of
least delay; a closed window's representative is its lowest point confirmed by a second within
`early_tolerance_ns` (a packet stamped late, which looks impossibly early, is ignored). When a
window opens, the line is refitted on the last `history` representatives of the epoch by an
asymmetric, recency-weighted least-squares fit (points above the line weigh `above_weight`,
those more than `congestion_ns` above it nothing, weights halve every `recency_ns` of source
time into the past), so a crystal whose drift follows its temperature is tracked, and a
congestion episode (every point above) neither lifts nor tilts it.

Faults are counted per source in `counts`: `wrap` (a wrapping timestamp, `wrap_ns`, moves into
its next cycle: never an epoch), `duplicate` (the same capture again within
`duplicate_window_ns`: it gets the first copy's reference time and does not touch the fit),
`gap` / `lost` (a hole in the source timeline still open `gap_confirm_ns` later, or at `close()`:
lost chunks, a silent sensor), `reset`, `outlier`, `delayed`, `previous_epoch`, `reordered`.

Resets: a packet whose source time jumps back more than `reset_back_ns` behind the newest one,
or arrives more than `reset_ahead_ns` earlier than the current line allows, opens a candidate
epoch. `reset_confirm` consistent packets promote it (counted as `reset`; the drift estimate
is kept, only the offset is new); if the old epoch goes on instead, the candidate's packets are
counted as `outlier`. Packets of the previous epoch that arrive late after a reset are mapped
with that epoch (`previous_epoch`); a packet that only looks like a jump back because it was
held up (up to `max_delay_ns`) is mapped with the current line (`delayed`). `latency_ns` is the
source's known fixed capture-to-arrival delay; it cannot be observed from timestamps alone.

`uncertainty_ns` is a bound on the mapping error of the newest packet: `uncertainty_k` times
(the scatter of the window representatives around the line + how far the last refits moved the
prediction for "now" + the mean gap between a window's two least delays, which estimates how
far the least one sits above the true minimum delay), plus `uncertainty_floor_ns`; a young epoch (fewer than 4 closed windows)
reports at least `young_uncertainty_ns`.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections import OrderedDict
from dataclasses import dataclass, field

from tristream.core.errors import InvalidPacket
from tristream.core.metrics import DropCounter
from tristream.core.packets import Packet

_INF = math.inf


@dataclass(slots=True)
class _Epoch:
    index: int
    s0: int
    a0: int
    c: float = 0.0
    max_src: int = 0
    packets: int = 0
    fitted: bool = False
    spread: float = 0.0
    # window key -> up to 4 least-delay points (z, x, y), ascending z = y - drift * x
    windows: OrderedDict[int, list[tuple[float, float, float]]] = field(default_factory=OrderedDict)
    rx: list[float] = field(default_factory=list)  # representatives of closed windows (x, y)
    ry: list[float] = field(default_factory=list)
    last_end: int = 0  # end of the newest in-order packet (source ns), for gaps
    period: float = 0.0  # typical step between in-order packets (source ns)
    holes: list[list[int]] = field(default_factory=list)  # [lo, hi] source ns, not yet confirmed gaps
    key: int = -1  # newest window key
    cycle: int = 0  # highest wrap cycle seen in this epoch
    held: int = 0  # refits in a row that found every point far above the line
    fit_packets: int = 0  # packets and closed windows at the last refit
    fit_windows: int = 0
    floor_gap: float = 0.0  # running mean gap between the two least delays of a window (ns)
    first_lo: int = -1  # the first step between packets without a span (frames), taken before
    first_hi: int = -1  # any period was known: a hole once the next step shows it held lost frames
    done: list[list[int]] = field(default_factory=list)  # the last holes confirmed as gaps
    overlap: bool = False  # a reset candidate opened by a chunk over samples already received

    def y_of(self, src_ns: int, arrival_ns: int) -> tuple[float, float]:
        x = float(src_ns - self.s0)
        return x, float(arrival_ns - self.a0) - x


@dataclass(frozen=True, slots=True)
class ClockState:
    """A snapshot of a `SourceClock` for reports and metrics."""

    source_id: str
    drift_ppm: float
    offset_ns: float
    uncertainty_ns: float
    epoch: int
    packets: int
    counts: dict[str, int]


class SourceClock:
    """Online map (offset + tracked drift) from one source's clock to the reference clock.

    Feed it (source ns, arrival ns) pairs with `observe`/`observe_span`/`map_packet`; each call
    returns the packet's capture time on the reference clock. Thread-confined.
    """

    def __init__(
        self,
        source_id: str = "src",
        *,
        latency_ns: int = 0,
        window_ns: int = 500_000_000,
        history: int = 60,
        q: float = 0.05,
        min_span_ns: int = 2_000_000_000,
        max_drift_ppm: float = 1000.0,
        reset_back_ns: int = 200_000_000,
        reset_ahead_ns: int = 100_000_000,
        reset_confirm: int = 3,
        early_tolerance_ns: int = 1_000_000,
        max_delay_ns: int = 2_000_000_000,
        wrap_ns: float = 0.0,
        duplicate_window_ns: int = 2_000_000_000,
        gap_confirm_ns: int = 1_000_000_000,
        recency_ns: float = 10e9,
        above_weight: float = 0.01,
        uncertainty_k: float = 3.0,
        uncertainty_floor_ns: float = 50_000.0,
        young_uncertainty_ns: float = 5_000_000.0,
        congestion_ns: float = 1_000_000.0,
        refit_packets: int = 10,
        silence_ns: int = 5_000_000_000,
    ) -> None:
        if window_ns <= 0 or history < 4 or reset_confirm < 1 or wrap_ns < 0:
            raise ValueError("window_ns must be > 0, history >= 4, reset_confirm >= 1 and wrap_ns >= 0")
        self.source_id = source_id
        self.latency_ns = int(latency_ns)
        self.window_ns = int(window_ns)
        self.history = int(history)
        self.q = float(q)  # kept for callers; the asymmetric fit's `above_weight` plays its part
        self.min_span_ns = int(min_span_ns)
        self.slope_bound = max_drift_ppm * 1e-6
        self.reset_back_ns = int(reset_back_ns)
        self.reset_ahead_ns = int(reset_ahead_ns)
        self.reset_confirm = int(reset_confirm)
        self.early_tolerance_ns = float(early_tolerance_ns)
        self.max_delay_ns = float(max_delay_ns)
        self.wrap_ns = float(wrap_ns)
        self.duplicate_window_ns = int(duplicate_window_ns)
        self.gap_confirm_ns = int(gap_confirm_ns)
        self.recency_ns = float(recency_ns)
        self.above_weight = float(above_weight)
        self.uncertainty_k = float(uncertainty_k)
        self.uncertainty_floor_ns = float(uncertainty_floor_ns)
        self.young_uncertainty_ns = float(young_uncertainty_ns)
        self.congestion_ns = float(congestion_ns)
        self.refit_packets = int(refit_packets)
        self.silence_ns = int(silence_ns)
        self._quarter_wrap = self.wrap_ns / 4
        self._cycle = 0  # wrap cycle of the packet being observed
        self.counts = DropCounter(f"clock:{source_id}")
        self._d = 0.0
        self._innov = 0.0
        self._epochs: list[_Epoch] = []
        self._cand: _Epoch | None = None
        self._cand_pts: list[tuple[int, int, int]] = []
        self._cand_normal = 0
        self._packets = 0
        self._last_src: int | None = None
        self._last_u: int | None = None  # newest unwrapped end (anchor of the unwrapping)
        # The last 512 packets, for duplicates: end -> slot, and per slot its start, ref and
        # arrival (one dict and three preallocated lists: no tuple per packet for the collector
        # to count and trace, one hashed store per packet)
        self._recent: dict[int, int] = {}
        self._recent_start: list[int] = [0] * 512
        self._recent_ref: list[int] = [0] * 512
        self._recent_arr: list[int] = [0] * 512
        self._recent_keys: list[int | None] = [None] * 512  # the ends by slot, oldest at _recent_at
        self._recent_at = 0
        self.last_epoch: _Epoch | None = None  # epoch (or reset candidate) the last packet was mapped with
        self.epoch_history: list[_Epoch] = []  # every epoch ever confirmed, oldest first

    @classmethod
    def for_unit(cls, source_id: str, unit: str, **kwargs: object) -> SourceClock:
        """A clock for timestamps in `unit` (`"us"`, `"rtp@90000"`, `"pts90k"`, ...): a wrapping
        unit sets `wrap_ns`, so its wraps are counted and never taken for resets. Times passed
        to `observe`/`observe_span` are still ns (`TimeUnit.to_ns` of the raw stamps)."""
        from tristream.core.units import parse_unit

        return cls(source_id, wrap_ns=parse_unit(unit).wrap_ns, **kwargs)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ public API
    @property
    def drift_ppm(self) -> float:
        """How fast the source clock runs relative to the reference, in ppm (+ = fast)."""
        return (1.0 / (1.0 + self._d) - 1.0) * 1e6

    @property
    def epoch(self) -> int:
        """Index of the current epoch (0 before the first reset)."""
        return self._epochs[-1].index if self._epochs else 0

    @property
    def offset_ns(self) -> float:
        """Reference minus source time (ns) at the newest source time seen."""
        if not self._epochs or self._last_src is None:
            return 0.0
        return self._map(self._epochs[-1], self._last_src) - self._last_src

    @property
    def uncertainty_ns(self) -> float:
        """Bound on the error of a mapping at the newest source time (ns); see the module docstring."""
        if not self._epochs:
            return math.inf
        ep = self.last_epoch if self.last_epoch is not None else self._epochs[-1]
        u = self.uncertainty_k * (ep.spread + self._innov + ep.floor_gap) + self.uncertainty_floor_ns
        if len(ep.rx) < 4 or ep is not self._epochs[-1]:
            u = max(u, self.young_uncertainty_ns)
        return u

    @property
    def open_gaps(self) -> int:
        """Holes in the source timeline not yet confirmed as gaps (a late packet may still fill them)."""
        return sum(len(ep.holes) for ep in self._epochs)

    def state(self) -> ClockState:
        """Snapshot of drift, offset, uncertainty, epoch and event counts."""
        return ClockState(
            source_id=self.source_id,
            drift_ppm=self.drift_ppm,
            offset_ns=self.offset_ns,
            uncertainty_ns=self.uncertainty_ns,
            epoch=self.epoch,
            packets=self._packets,
            counts=self.counts.snapshot(),
        )

    def observe(self, src_ns: int, arrival_ns: int) -> int:
        """Learn from one (source ns, arrival ns) pair; return its capture time in reference ns."""
        return self.observe_span(src_ns, src_ns, arrival_ns)

    def observe_span(self, start_src_ns: int, end_src_ns: int, arrival_ns: int) -> int:
        """Learn from a packet spanning [start, end] source ns that arrived after its end.

        Returns the reference time of `start` (an audio chunk's first sample). With `wrap_ns`,
        the times are raw (wrapped) and a span may cross the wrap.
        """
        if type(start_src_ns) is int and type(end_src_ns) is int and type(arrival_ns) is int:
            start, end, arrival = start_src_ns, end_src_ns, arrival_ns
        else:
            try:
                start, end, arrival = int(start_src_ns), int(end_src_ns), int(arrival_ns)
            except (TypeError, ValueError, OverflowError):
                raise InvalidPacket(
                    f"{self.source_id}: times must be integer ns, got start={start_src_ns!r} end={end_src_ns!r} "
                    f"arrival={arrival_ns!r}"
                ) from None
        cycle = 0
        w = self.wrap_ns
        if w:
            dur = end - start
            if dur < 0:
                dur += round(w)
            last = self._last_u
            # The cycle is counted, not recomputed from the unwrapped time: a raw 0 moved into
            # cycle k lands at round(k * wrap_ns), which may sit a fraction of a ns below k * wrap_ns.
            cycle = math.floor(end / w)
            if last is not None and not -self._quarter_wrap <= last - end <= self._quarter_wrap:
                # (within a quarter cycle of its predecessor a timestamp stays in its cycle)
                k = round((last - end) / w)
                if k:
                    end = end + round(k * w)
                    cycle += k
            start = end - dur
            self._last_u = end
            self._cycle = cycle
        if end < start:
            raise InvalidPacket(f"{self.source_id}: span ends ({end}) before it starts ({start})")
        recent = self._recent
        slot = recent.get(end)
        if slot is not None and self._recent_start[slot] == start and (
            0 <= arrival - self._recent_arr[slot] <= self.duplicate_window_ns
        ):
            self.counts.add("duplicate")
            return self._recent_ref[slot]
        eps = self._epochs
        ep = eps[-1] if eps else None
        if ep is not None and self._cand is None and end >= ep.max_src - self.reset_back_ns:
            # the common case, inlined: the packet fits the current epoch's line
            x = float(end - ep.s0)
            y = float(arrival - ep.a0) - x
            if y - (ep.c + self._d * x) >= -self.reset_ahead_ns and not (
                end < ep.max_src and start < end and self._overlaps(ep, start, end)
            ):
                self._packets += 1
                self._add_point(ep, start, end, arrival, x, y)
            else:
                ep = self._update(start, end, arrival)
        else:
            ep = self._update(start, end, arrival)
        self.last_epoch = ep
        ref = ep.a0 + round(ep.c + (1.0 + self._d) * float(start - ep.s0)) - self.latency_ns
        if w and cycle > ep.cycle and ep is self._epochs[-1]:
            if ep.packets > 1:
                self.counts.add("wrap", cycle - ep.cycle)
            ep.cycle = cycle
        at = self._recent_at
        recent[end] = at
        self._recent_start[at] = start
        self._recent_ref[at] = ref
        self._recent_arr[at] = arrival
        keys = self._recent_keys
        old = keys[at]
        keys[at] = end
        self._recent_at = (at + 1) & 511
        if old is not None and old in recent:  # (the slot's previous packet leaves, even when
            del recent[old]  # its end came again since: the window is 512 packets either way)
        return ref

    def map_packet(self, pkt: Packet) -> int:
        """Observe `pkt` (its end of capture against its arrival) and set `pkt.ref_ns`."""
        ref = self.observe_span(pkt.src_ns, pkt.src_end_ns, pkt.arrival_ns)
        pkt.ref_ns = ref
        return ref

    def close(self) -> None:
        """End of the stream: holes still open can no longer be filled, so each is counted as a
        `gap` (with its `lost` packets) now instead of `gap_confirm_ns` of source time later."""
        for ep in self._epochs:
            if ep.holes:
                self._confirm_holes(ep, sys.maxsize)  # later than any hole's confirmation time

    def to_ref(self, src_ns: int) -> int:
        """Map a source time with the current epoch's estimate, without learning from it."""
        if not self._epochs:
            raise InvalidPacket(f"{self.source_id}: clock has seen no packet yet; observe one first")
        return self._map(self._epochs[-1], int(src_ns))

    # ------------------------------------------------------------------ internals
    def _map(self, ep: _Epoch, src_ns: int) -> int:
        x = float(src_ns - ep.s0)
        return ep.a0 + round(ep.c + (1.0 + self._d) * x) - self.latency_ns

    def _gap(self, ep: _Epoch, src_ns: int, arrival_ns: int) -> float:
        x = float(src_ns - ep.s0)
        return float(arrival_ns - ep.a0) - x - (ep.c + self._d * x)

    def _fits(self, ep: _Epoch, src_ns: int, arrival_ns: int) -> bool:
        if src_ns < ep.max_src - self.reset_back_ns:
            return False
        return self._gap(ep, src_ns, arrival_ns) >= -self.reset_ahead_ns

    def _new_epoch(self, src_ns: int, arrival_ns: int) -> _Epoch:
        index = self._epochs[-1].index + 1 if self._epochs else 0
        ep = _Epoch(index=index, s0=src_ns, a0=arrival_ns, max_src=src_ns)
        if self.wrap_ns:
            ep.cycle = self._cycle  # the packet's, as observe_span counted it
        return ep

    def _update(self, start: int, src_ns: int, arrival_ns: int) -> _Epoch:
        self._packets += 1
        if not self._epochs:
            ep = self._new_epoch(src_ns, arrival_ns)
            self._epochs.append(ep)
            self.epoch_history.append(ep)
            self._add_point(ep, start, src_ns, arrival_ns)
            return ep
        ep = self._epochs[-1]
        overlap = src_ns < ep.max_src and start < src_ns and self._overlaps(ep, start, src_ns)
        if self._fits(ep, src_ns, arrival_ns) and not overlap and not self._continues(ep, start, src_ns, arrival_ns):
            if self._cand is not None:
                self._cand_normal += 1
                if self._cand_normal >= self.reset_confirm:
                    self.counts.add("outlier", len(self._cand_pts))
                    self._cand = None
                    self._cand_pts = []
            self._add_point(ep, start, src_ns, arrival_ns)
            return ep
        if len(self._epochs) > 1:
            prev = self._epochs[-2]
            if src_ns <= prev.max_src + self.reset_back_ns and self._fits(prev, src_ns, arrival_ns) and (
                abs(self._gap(prev, src_ns, arrival_ns)) < self.reset_back_ns
            ):
                self.counts.add("previous_epoch")
                if prev.holes:  # a late packet of the old epoch still fills its hole
                    self._fill(prev, start, src_ns)
                return prev
        if ep.holes and self._gap(ep, src_ns, arrival_ns) >= 0.0 and self._in_hole(ep, start, src_ns):
            # It lands in a hole of the timeline, later than the line allows: a packet held up
            # (behind a successor that came after a silence, however long), never a reset.
            self.counts.add("delayed")
            self._fill(ep, start, src_ns)
            return ep
        cand = self._candidate(start, src_ns, arrival_ns)
        if overlap and len(self._cand_pts) == 1:
            cand.overlap = True  # a candidate that its next chunks continue (see `_continues`)
        if cand is not self._epochs[-1] and 0.0 <= self._gap(ep, src_ns, arrival_ns) <= self.max_delay_ns:
            # Most likely a packet that was merely held up (its source time is consistent with
            # the line, it just arrived late): map it with the current epoch until a reset is
            # confirmed. It still counts towards a reset candidate in case it is the first of many.
            self.counts.add("delayed")
            if ep.holes:  # it was received: the hole it sits in is not a loss
                self._fill(ep, start, src_ns)
            return ep
        return cand

    def _candidate(self, start: int, src_ns: int, arrival_ns: int) -> _Epoch:
        cand = self._cand
        if cand is not None and self._fits(cand, src_ns, arrival_ns) and (
            self._gap(cand, src_ns, arrival_ns) < self.reset_back_ns
        ):
            self._cand_pts.append((start, src_ns, arrival_ns))
            cand.max_src = max(cand.max_src, src_ns)
            x = float(src_ns - cand.s0)
            cand.c = min(cand.c, float(arrival_ns - cand.a0) - x - self._d * x)
            if len(self._cand_pts) >= self.reset_confirm:
                self._promote(cand)
            return cand
        if cand is not None:
            self.counts.add("outlier", len(self._cand_pts))
        cand = self._new_epoch(src_ns, arrival_ns)
        self._cand = cand
        self._cand_pts = [(start, src_ns, arrival_ns)]
        self._cand_normal = 0
        if self.reset_confirm <= 1:
            self._promote(cand)
        return cand

    def _promote(self, cand: _Epoch) -> None:
        self.counts.add("reset")
        self._epochs.append(cand)
        self.epoch_history.append(cand)
        if len(self._epochs) > 4:
            self._epochs.pop(0)
        pts = self._cand_pts
        self._cand = None
        self._cand_pts = []
        cand.c = 0.0
        cand.max_src = cand.s0
        for st, s, a in pts:
            self._add_point(cand, st, s, a)

    def _add_point(self, ep: _Epoch, start: int, src_ns: int, arrival_ns: int, x: float | None = None,
                   y: float = 0.0) -> None:
        ep.packets += 1
        packets = ep.packets
        if src_ns < ep.max_src:
            self.counts.add("reordered")
            if ep.holes:
                self._fill(ep, start, src_ns)
            if ep.first_lo < src_ns < ep.first_hi:
                ep.first_hi = -1  # a frame inside the first step: it is no hole of lost ones
        else:
            if packets > 1:
                last_end = ep.last_end
                if start - last_end > self.silence_ns:
                    # Back after a long silence: the drift may have wandered meanwhile, so the line is
                    # re-anchored on what comes now (drift kept, offset refitted, reported as young).
                    ep.rx.clear()
                    ep.ry.clear()
                    ep.fitted = False
                    ep.c = _INF
                    ep.fit_windows = ep.held = 0
                span = src_ns - start
                holes = ep.holes
                if span > 0:
                    if start - last_end > span // 2:
                        holes.append([last_end, start, span])
                else:
                    step = src_ns - last_end
                    p = ep.period
                    if p > 0 and step > 1.5 * p:
                        holes.append([last_end, src_ns, 0])
                    elif step > 0:
                        if p == 0:
                            ep.first_lo, ep.first_hi = last_end, src_ns
                        elif ep.first_hi >= 0:
                            if ep.first_hi - ep.first_lo > 1.5 * step:  # the first step lost frames
                                holes.insert(0, [ep.first_lo, ep.first_hi, 0])
                                p = step
                            ep.first_hi = -1
                        ep.period = step if p == 0 else p + 0.1 * (step - p)
                if holes and holes[0][1] < src_ns - self.gap_confirm_ns:
                    self._confirm_holes(ep, src_ns)
            ep.last_end = src_ns
            ep.max_src = src_ns
            if ep is self._epochs[-1]:
                self._last_src = src_ns
        if x is None:  # (the caller's x and y when it computed them for the same epoch)
            x = float(src_ns - ep.s0)
            y = float(arrival_ns - ep.a0) - x
        z = y - self._d * x
        if packets == 1 or ep.c == _INF:
            ep.c = z
        key = int(x // self.window_ns)
        windows = ep.windows
        pts = windows.get(key)
        if pts is None:
            windows[key] = [(z, x, y)]
            if key > ep.key:
                if ep.key >= 0:
                    closed = windows.get(ep.key)
                    if closed is not None:
                        self._close_window(ep, closed)
                ep.key = key
            while len(windows) > 4:
                windows.popitem(last=False)
        elif len(pts) < 4 or z < pts[-1][0]:
            bisect.insort(pts, (z, x, y))
            del pts[4:]
        else:
            return
        # In the first windows of an epoch the intercept is the lowest confirmed window
        # representative: follow it per packet instead of waiting for the next refit (this
        # shortens the transient after a reset).
        if not ep.fitted:
            rep, confirmed = self._rep(windows[key])
            if confirmed and rep[0] < ep.c:
                ep.c = rep[0]

    def _close_window(self, ep: _Epoch, closed: list[tuple[float, float, float]]) -> None:
        """A window closed: keep its representative, refit when enough is new."""
        rep = self._rep(closed)[0]
        if len(closed) > 1:
            # The gap between a window's two least delays estimates how far its least one sits
            # above the true floor (order statistics of the delay).
            g = closed[1][0] - closed[0][0]
            if g <= self.early_tolerance_ns:
                ep.floor_gap += 0.1 * (g - ep.floor_gap)
        ep.rx.append(rep[1])
        ep.ry.append(rep[2])
        if len(ep.rx) > 2 * self.history:
            del ep.rx[: self.history]
            del ep.ry[: self.history]
        # A refit per window, but not for fewer than `refit_packets` new packets (a slow
        # sensor) unless four windows went by.
        if ep.packets - ep.fit_packets >= self.refit_packets or len(ep.rx) - ep.fit_windows >= 4 or len(ep.rx) < 8:
            ep.fit_packets = ep.packets
            ep.fit_windows = len(ep.rx)
            self._refit(ep)

    def _continues(self, ep: _Epoch, start: int, end: int, arrival: int) -> bool:
        """Whether a chunk continues the timeline of a candidate epoch opened by overlapping
        samples (it starts where the candidate's newest chunk ended, not where the epoch's did):
        a restart one or two chunks behind has fewer than `reset_confirm` overlapping chunks."""
        c = self._cand
        if c is None or not c.overlap or start >= end:
            return False
        tol = (end - start) // 4
        return abs(start - c.max_src) <= tol < abs(start - ep.last_end) and self._fits(c, end, arrival)

    def _overlaps(self, ep: _Epoch, start: int, end: int) -> bool:
        """Whether a span behind the newest one covers samples already received in this epoch: in
        no open hole of its timeline and no recently confirmed one. The same samples twice (other
        than a duplicate) cannot come from one epoch of a clock: its source restarted a little
        behind where it was (at raw 0 just after a wrap, say), which a step back too short for
        `reset_back_ns` would otherwise pass as reordering."""
        if end <= ep.s0 or start < ep.s0 - (end - start):
            return False
        if ep.holes and self._in_hole(ep, start, end):
            return False
        tol = (end - start) // 2
        for lo, hi, _ in ep.done:
            if lo - tol <= start and end <= hi + tol:
                return False
        return True

    def _in_hole(self, ep: _Epoch, start: int, end: int) -> bool:
        """Whether [start, end] lies in one of the epoch's open holes."""
        for lo, hi, span in ep.holes:
            tol = span // 2 if span else 0.5 * ep.period
            if lo - tol <= start and end <= hi + tol:
                return True
        return False

    def _fill(self, ep: _Epoch, start: int, end: int) -> None:
        """A reordered packet lands in a hole: shrink or split it."""
        for i, h in enumerate(ep.holes):
            lo, hi, span = h
            if end <= lo or start >= hi:
                continue
            tol = span // 2 if span else int(0.5 * ep.period)
            left, right = start - lo > tol, hi - end > tol
            if span == 0:
                left, right = start - lo > 1.5 * ep.period, hi - end > 1.5 * ep.period
            if left and right:
                ep.holes[i : i + 1] = [[lo, start, span], [end, hi, span]]
            elif left:
                h[1] = start
            elif right:
                h[0] = end
            else:
                del ep.holes[i]
            return

    def _confirm_holes(self, ep: _Epoch, now_src: int) -> None:
        while ep.holes and ep.holes[0][1] < now_src - self.gap_confirm_ns:
            lo, hi, span = ep.holes.pop(0)
            ep.done.append([lo, hi, span])
            if len(ep.done) > 8:
                del ep.done[0]
            self.counts.add("gap")
            if span:
                self.counts.add("lost", max(1, round((hi - lo) / span)))
            elif ep.period > 0:
                self.counts.add("lost", max(1, round((hi - lo) / ep.period) - 1))

    def _rep(self, pts: list[tuple[float, float, float]]) -> tuple[tuple[float, float, float], bool]:
        """A window's least-delay point, confirmed by a second one within `early_tolerance_ns`.

        A packet that seems to arrive earlier than every other one of its window by more than
        the tolerance (a timestamp stamped late, a clock glitch) is physically implausible and
        must not drag the envelope down; without a confirmed pair the minimum is used.
        """
        for i in range(len(pts) - 1):
            if pts[i + 1][0] - pts[i][0] <= self.early_tolerance_ns:
                return pts[i], True
        return (pts[1] if len(pts) > 2 else pts[0]), False

    def _refit(self, ep: _Epoch) -> None:
        # Plain Python over the (at most `history`) window representatives: at this size it
        # costs a third of the same fit as numpy calls on small arrays.
        n = len(ep.rx)
        if n == 0:
            return
        h = self.history
        xs = ep.rx[-h:]
        ys = ep.ry[-h:]
        x_now = float(ep.max_src - ep.s0)
        d = self._d
        c = ep.c
        old = c + d * x_now
        x_end = xs[-1]
        if n >= 4 and x_end - xs[0] >= self.min_span_ns:
            xc = [x - x_end for x in xs]  # centred on the newest window: no cancellation in the sums
            c0 = c + d * x_end
            # Which points may move the line is decided against the line before this refit, so a
            # slow congestion ramp cannot walk the line upwards; one reweighting step per refit
            # (the fit is iterated across refits, a window apart). Points far above (congestion,
            # stalls) get no weight, the rest 1 below the line and `above_weight` above it; a
            # representative far below the line is a packet stamped late: no weight either.
            tol = self.congestion_ns + 2.0 * ep.spread
            above = self.above_weight
            k = 1.0 / self.recency_ns
            # Every point far above the line: congestion holds the line; only when it lasts a
            # whole history has the floor itself moved, and the line follows it (the same sums
            # again, every point weighted by its recency alone).
            every = False
            while True:
                ws = []
                sw = sx = sy = sxx = sxy = 0.0
                first = last = 0.0
                m = 0
                for x, y in zip(xc, ys, strict=True):
                    if every:
                        w = 1.0
                    else:
                        r = y - c0 - d * x
                        w = (1.0 if r >= -tol else 0.0) if r <= 0.0 else (above if r <= tol else 0.0)
                    if w:
                        w *= 2.0 ** (x * k)
                        sw += w
                        wx = w * x
                        sx += wx
                        sy += w * y
                        sxx += wx * x
                        sxy += wx * y
                        if not m:
                            first = x
                        last = x
                        m += 1
                    ws.append(w)
                if sw > 0.0 or every:
                    break
                ep.held += 1
                if ep.held < self.history:
                    return
                every = True
            if not every:
                ep.held = 0
            sxx -= sx * sx / sw
            if m >= 3 and last - first >= self.min_span_ns and sxx > 0:
                d = (sxy - sx * sy / sw) / sxx
                d = min(max(d, -self.slope_bound), self.slope_bound)
                if abs(d) >= self.slope_bound * 0.999:
                    self.counts.add("drift_at_bound")
                c0 = (sy - d * sx) / sw
            else:
                # too few trustworthy points to tilt the line: keep the drift, move the offset
                z = sorted([y - d * x for w, x, y in zip(ws, xc, ys, strict=True) if w > 0.0])
                c0 = z[0] if len(z) < 3 else z[1]
            self._d = d
            ep.c = c0 - d * x_end
            ep.fitted = True
            cn = self.congestion_ns
            a = []
            for x, y in zip(xc[-16:], ys[-16:], strict=True):
                r = y - c0 - d * x
                if r <= cn:
                    a.append(abs(r))
            if a:
                a.sort()
                ep.spread = a[len(a) // 2]
        else:
            z = sorted([y - d * x for x, y in zip(xs, ys, strict=True)])
            c = z[0] if n < 3 else z[1]
            if not ep.fitted or c < ep.c:
                ep.c = c
        new = ep.c + self._d * x_now
        self._innov = max(abs(new - old), 0.7 * self._innov)
