"""`SourceClock`: maps one source's timestamps onto the reference clock (monotonic ns).

Model: a packet captured at source time `s` (ns of the source clock) was captured at reference
time `ref = a0 + c + (1 + d) * (s - s0)` and arrived at `ref + latency + delay`, delay >= 0.
The fit runs along the lower envelope of (s, arrival) - the minimum-delay line - so heavy-tailed
jitter, spikes and reordering only ever sit above it (see `envelope.py`).

Online and bounded: each epoch keeps, per window of `window_ns` source time, its few points of
least delay; the window's representative is the lowest one confirmed by a second within
`early_tolerance_ns` (so a packet stamped late, which looks impossibly early, is ignored). The
last `history` windows (over all epochs) are refitted whenever a new window opens (twice a
second by default): one shared drift and one offset per epoch, on the `q`-quantile of the
representatives (5 %: a few contaminated windows cannot drag the line down).

Resets: a packet whose source time jumps back more than `reset_back_ns` behind the newest one,
or arrives more than `reset_ahead_ns` earlier than the current line allows, opens a candidate
epoch. `reset_confirm` consistent packets promote it (counted as `reset`; the drift estimate
is kept, only the offset is new); if the old epoch goes on instead, the candidate's packets are
counted as `outlier`. Packets of the previous epoch that arrive late after a reset are mapped
with that epoch (`previous_epoch`); a packet that only looks like a jump back because it was
held up (up to `max_delay_ns`) is mapped with the current line (`delayed`). `latency_ns` is the source's known fixed capture-to-arrival
delay (device/pipeline latency); it cannot be observed from timestamps alone.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from tristream.core.envelope import fit_lower_envelope
from tristream.core.errors import InvalidPacket
from tristream.core.metrics import DropCounter
from tristream.core.packets import Packet


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
    """Online affine map (offset + drift) from one source's clock to the reference clock.

    Feed it (source ns, arrival ns) pairs with `observe`/`observe_span`/`map_packet`; each call
    returns the packet's capture time on the reference clock. Thread-confined.
    """

    def __init__(
        self,
        source_id: str = "src",
        *,
        latency_ns: int = 0,
        window_ns: int = 500_000_000,
        history: int = 240,
        q: float = 0.05,
        min_span_ns: int = 2_000_000_000,
        max_drift_ppm: float = 1000.0,
        reset_back_ns: int = 200_000_000,
        reset_ahead_ns: int = 100_000_000,
        reset_confirm: int = 3,
        early_tolerance_ns: int = 1_000_000,
        max_delay_ns: int = 2_000_000_000,
    ) -> None:
        if window_ns <= 0 or history < 4 or reset_confirm < 1:
            raise ValueError("window_ns must be > 0, history >= 4 and reset_confirm >= 1")
        self.source_id = source_id
        self.latency_ns = int(latency_ns)
        self.window_ns = int(window_ns)
        self.history = int(history)
        self.q = float(q)
        self.min_span_ns = int(min_span_ns)
        self.slope_bound = max_drift_ppm * 1e-6
        self.reset_back_ns = int(reset_back_ns)
        self.reset_ahead_ns = int(reset_ahead_ns)
        self.reset_confirm = int(reset_confirm)
        self.early_tolerance_ns = float(early_tolerance_ns)
        self.max_delay_ns = float(max_delay_ns)
        self.counts = DropCounter(f"clock:{source_id}")
        self._d = 0.0
        self._slope_fitted = False
        self._slope_se = 0.0
        self._x_mean = 0.0
        self._epochs: list[_Epoch] = []
        self._cand: _Epoch | None = None
        self._cand_pts: list[tuple[int, int]] = []
        self._cand_normal = 0
        self._nwin = 0
        self._packets = 0
        self._last_src: int | None = None
        self.last_epoch: _Epoch | None = None  # epoch (or reset candidate) the last packet was mapped with
        self.epoch_history: list[_Epoch] = []  # every epoch ever confirmed, oldest first

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
        """Heuristic 1-sigma error of a mapping at the newest source time (ns)."""
        if not self._epochs:
            return math.inf
        ep = self._epochs[-1]
        n = max(1, len(ep.windows))
        x = float((self._last_src or ep.s0) - ep.s0)
        return ep.spread / math.sqrt(n) + self._slope_se * abs(x - self._x_mean)

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

        Returns the reference time of `start` (an audio chunk's first sample).
        """
        try:
            start_src_ns, end_src_ns, arrival_ns = int(start_src_ns), int(end_src_ns), int(arrival_ns)
        except (TypeError, ValueError, OverflowError):
            raise InvalidPacket(
                f"{self.source_id}: times must be integer ns, got start={start_src_ns!r} end={end_src_ns!r} "
                f"arrival={arrival_ns!r}"
            ) from None
        if end_src_ns < start_src_ns:
            raise InvalidPacket(
                f"{self.source_id}: span ends ({end_src_ns}) before it starts ({start_src_ns})"
            )
        ep = self._update(end_src_ns, arrival_ns)
        self.last_epoch = ep
        return self._map(ep, start_src_ns)

    def map_packet(self, pkt: Packet) -> int:
        """Observe `pkt` (its end of capture against its arrival) and set `pkt.ref_ns`."""
        ref = self.observe_span(pkt.src_ns, pkt.src_end_ns, pkt.arrival_ns)
        pkt.ref_ns = ref
        return ref

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
        x, y = ep.y_of(src_ns, arrival_ns)
        return y - (ep.c + self._d * x)

    def _fits(self, ep: _Epoch, src_ns: int, arrival_ns: int) -> bool:
        if src_ns < ep.max_src - self.reset_back_ns:
            return False
        return self._gap(ep, src_ns, arrival_ns) >= -self.reset_ahead_ns

    def _new_epoch(self, src_ns: int, arrival_ns: int) -> _Epoch:
        index = self._epochs[-1].index + 1 if self._epochs else 0
        return _Epoch(index=index, s0=src_ns, a0=arrival_ns, max_src=src_ns)

    def _update(self, src_ns: int, arrival_ns: int) -> _Epoch:
        self._packets += 1
        if not self._epochs:
            ep = self._new_epoch(src_ns, arrival_ns)
            self._epochs.append(ep)
            self.epoch_history.append(ep)
            self._add_point(ep, src_ns, arrival_ns)
            return ep
        ep = self._epochs[-1]
        if self._fits(ep, src_ns, arrival_ns):
            if self._cand is not None:
                self._cand_normal += 1
                if self._cand_normal >= self.reset_confirm:
                    self.counts.add("outlier", len(self._cand_pts))
                    self._cand = None
                    self._cand_pts = []
            self._add_point(ep, src_ns, arrival_ns)
            return ep
        if len(self._epochs) > 1:
            prev = self._epochs[-2]
            if src_ns <= prev.max_src + self.reset_back_ns and self._fits(prev, src_ns, arrival_ns) and (
                abs(self._gap(prev, src_ns, arrival_ns)) < self.reset_back_ns
            ):
                self.counts.add("previous_epoch")
                return prev
        cand = self._candidate(src_ns, arrival_ns)
        if cand is not self._epochs[-1] and 0.0 <= self._gap(ep, src_ns, arrival_ns) <= self.max_delay_ns:
            # Most likely a packet that was merely held up (its source time is consistent with
            # the line, it just arrived late): map it with the current epoch until a reset is
            # confirmed. It still counts towards a reset candidate in case it is the first of many.
            self.counts.add("delayed")
            return ep
        return cand

    def _candidate(self, src_ns: int, arrival_ns: int) -> _Epoch:
        cand = self._cand
        if cand is not None and self._fits(cand, src_ns, arrival_ns) and (
            self._gap(cand, src_ns, arrival_ns) < self.reset_back_ns
        ):
            self._cand_pts.append((src_ns, arrival_ns))
            cand.max_src = max(cand.max_src, src_ns)
            _, y = cand.y_of(src_ns, arrival_ns)
            x = float(src_ns - cand.s0)
            cand.c = min(cand.c, y - self._d * x)
            if len(self._cand_pts) >= self.reset_confirm:
                self._promote(cand)
            return cand
        if cand is not None:
            self.counts.add("outlier", len(self._cand_pts))
        cand = self._new_epoch(src_ns, arrival_ns)
        self._cand = cand
        self._cand_pts = [(src_ns, arrival_ns)]
        self._cand_normal = 0
        if self.reset_confirm <= 1:
            self._promote(cand)
        return cand

    def _promote(self, cand: _Epoch) -> None:
        self.counts.add("reset")
        self._epochs.append(cand)
        self.epoch_history.append(cand)
        if len(self._epochs) > 4:
            dropped = self._epochs.pop(0)
            self._nwin -= len(dropped.windows)
        pts = self._cand_pts
        self._cand = None
        self._cand_pts = []
        cand.c = 0.0
        cand.max_src = cand.s0
        for s, a in pts:
            self._add_point(cand, s, a)

    def _add_point(self, ep: _Epoch, src_ns: int, arrival_ns: int) -> None:
        ep.packets += 1
        if src_ns < ep.max_src:
            self.counts.add("reordered")
        else:
            ep.max_src = src_ns
            if ep is self._epochs[-1]:
                self._last_src = src_ns
        x, y = ep.y_of(src_ns, arrival_ns)
        z = y - self._d * x
        if ep.packets == 1:
            ep.c = z
        key = (src_ns - ep.s0) // self.window_ns
        pts = ep.windows.get(key)
        if pts is None:
            ep.windows[key] = [(z, x, y)]
            self._nwin += 1
            self._evict()
            if len(ep.windows) >= 2:
                self._refit()
        elif len(pts) < 4 or z < pts[-1][0]:
            bisect.insort(pts, (z, x, y))
            del pts[4:]
        else:
            return
        # In the first windows of an epoch the intercept is the lowest confirmed window
        # representative: follow it per packet instead of waiting for the next refit (this
        # shortens the transient after a reset).
        if not ep.fitted or len(ep.windows) < 4:
            rep, confirmed = self._rep(ep.windows[key])
            if confirmed and rep[0] < ep.c:
                ep.c = rep[0]

    def _rep(self, pts: list[tuple[float, float, float]]) -> tuple[tuple[float, float, float], bool]:
        """A window's least-delay point, confirmed by a second one within `early_tolerance_ns`.

        A packet that seems to arrive earlier than every other one of its window by more than
        the tolerance (a timestamp stamped late, a clock glitch) is physically implausible and
        must not drag the envelope down; without a confirmed pair the minimum is used.
        """
        for i in range(len(pts) - 1):
            if pts[i + 1][0] - pts[i][0] <= self.early_tolerance_ns:
                return pts[i], True
        return (pts[1] if len(pts) > 1 else pts[0]), False

    def _evict(self) -> None:
        while self._nwin > self.history:
            for ep in self._epochs:
                if ep.windows:
                    ep.windows.popitem(last=False)
                    self._nwin -= 1
                    break

    def _refit(self) -> None:
        live = [ep for ep in self._epochs if ep.windows]
        # The newest window has only just opened: a lone (possibly stamped-late) point at the end
        # of the range would act as a lever on the slope, so fit on closed windows only.
        reps = [[self._rep(pts)[0] for pts in itertools.islice(ep.windows.values(), max(1, len(ep.windows) - 1))]
                for ep in live]
        xs = [np.fromiter((r[1] for r in rs), float, len(rs)) for rs in reps]
        ys = [np.fromiter((r[2] for r in rs), float, len(rs)) for rs in reps]
        slope_eps = [i for i, xe in enumerate(xs) if xe.size >= 3 and float(xe.max() - xe.min()) > 0]
        span = sum(float(xs[i].max() - xs[i].min()) for i in slope_eps)
        if slope_eps and span >= self.min_span_ns:
            fit = fit_lower_envelope(
                [xs[i] for i in slope_eps],
                [ys[i] for i in slope_eps],
                q=self.q,
                slope_bound=self.slope_bound,
                guess=self._d if self._slope_fitted else None,
                guess_width=max(2e-6, 20.0 * self._slope_se),
                min_below=1,
            )
            self._slope_fitted = True
            if fit.at_bound:
                self.counts.add("drift_at_bound")
            self._d = fit.slope
            sxx = sum(float(np.sum((xs[i] - xs[i].mean()) ** 2)) for i in slope_eps)
            spread = float(np.median(fit.spread))
            self._slope_se = spread / math.sqrt(sxx) if sxx > 0 else 0.0
            cur = xs[-1]
            self._x_mean = float(cur.mean())
        fit = fit_lower_envelope(xs, ys, q=self.q, slope_bound=self.slope_bound, fixed_slope=self._d, min_below=1)
        for ep, c, sp in zip(live, fit.intercepts, fit.spread, strict=True):
            ep.c = float(c)
            ep.spread = float(sp)
            ep.fitted = True
