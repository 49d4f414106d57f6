"""Per-stream watermarks with lateness and idleness, and their combination.

A stream's watermark is `max seen reference time - lateness`: once it passes t, no more data
at or before t is expected from that stream (anything that still comes is *late* and counted).
A stream that has delivered nothing for `idle_timeout_ns` of processing time is *idle* and
leaves the combined watermark (the minimum over active streams), so a silent camera cannot
stall the microphone. The combined watermark never goes backwards. Processing time (`now_ns`)
is passed in by the caller, so tests drive it with a virtual clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tristream.core.metrics import DropCounter

NEG_INF = -(1 << 62)
POS_INF = 1 << 62


@dataclass(slots=True)
class StreamWatermark:
    """Watermark state of one stream."""

    name: str
    lateness_ns: int
    idle_timeout_ns: int
    max_seen_ns: int = NEG_INF
    last_active_ns: int = NEG_INF
    closed: bool = False

    @property
    def watermark_ns(self) -> int:
        """Max seen reference time minus the allowed lateness (or +inf once closed)."""
        if self.closed:
            return POS_INF
        return self.max_seen_ns - self.lateness_ns if self.max_seen_ns > NEG_INF else NEG_INF

    def is_idle(self, now_ns: int) -> bool:
        """True when no data came for longer than the idleness timeout (closed streams are idle)."""
        return self.closed or (self.last_active_ns > NEG_INF and now_ns - self.last_active_ns > self.idle_timeout_ns)


class WatermarkTracker:
    """Watermarks of N streams and their combined minimum over the active ones."""

    def __init__(self, lateness_ns: int = 100_000_000, idle_timeout_ns: int = 500_000_000) -> None:
        if lateness_ns < 0 or idle_timeout_ns <= 0:
            raise ValueError("lateness_ns must be >= 0 and idle_timeout_ns > 0")
        self.lateness_ns = int(lateness_ns)
        self.idle_timeout_ns = int(idle_timeout_ns)
        self.streams: dict[str, StreamWatermark] = {}
        self.counts = DropCounter("watermark")
        self._combined = NEG_INF
        self._unstarted = False  # a registered stream has no processing time yet

    def add_stream(self, name: str, *, lateness_ns: int | None = None, idle_timeout_ns: int | None = None) -> None:
        """Register a stream (streams are also added on first `observe`)."""
        if name not in self.streams:
            self.streams[name] = StreamWatermark(
                name,
                self.lateness_ns if lateness_ns is None else int(lateness_ns),
                self.idle_timeout_ns if idle_timeout_ns is None else int(idle_timeout_ns),
            )
            self._unstarted = True

    def _start(self, now_ns: int) -> None:
        # A registered stream that has not delivered yet counts as active from the first
        # processing time the tracker sees, so it gets one idleness timeout to start.
        if not self._unstarted:
            return
        self._unstarted = False
        for s in self.streams.values():
            if s.last_active_ns == NEG_INF:
                s.last_active_ns = now_ns

    def observe(self, name: str, ref_ns: int, now_ns: int) -> bool:
        """Record data at `ref_ns` arriving at processing time `now_ns`; False if it is late.

        Late means older than the stream's own watermark or than the combined watermark already
        published; it is counted as `late:<stream>` and the caller should not use it.
        """
        s = self.streams.get(name)
        if s is None:
            self.add_stream(name)
            s = self.streams[name]
        self._start(now_ns)
        s.last_active_ns = max(s.last_active_ns, now_ns)
        if s.closed:
            s.closed = False
        late = ref_ns < s.watermark_ns or ref_ns < self._combined
        if ref_ns > s.max_seen_ns:
            s.max_seen_ns = ref_ns
        if late:
            self.counts.add(f"late:{name}")
        return not late

    def close(self, name: str) -> None:
        """End of stream: it no longer holds the combined watermark back."""
        self.add_stream(name)
        self.streams[name].closed = True

    def watermark(self, name: str) -> int:
        """One stream's watermark."""
        return self.streams[name].watermark_ns

    def active(self, now_ns: int) -> list[str]:
        """Streams that are not idle at `now_ns`."""
        return [n for n, s in self.streams.items() if not s.is_idle(now_ns)]

    def combined(self, now_ns: int) -> int:
        """Min watermark over active streams (max over all when every stream is idle); monotonic."""
        if not self.streams:
            return self._combined
        self._start(now_ns)
        value = POS_INF
        for s in self.streams.values():
            if s.closed or (s.last_active_ns > NEG_INF and now_ns - s.last_active_ns > s.idle_timeout_ns):
                continue
            m = s.max_seen_ns - s.lateness_ns if s.max_seen_ns > NEG_INF else NEG_INF
            if m < value:
                value = m
        return self._raise_to(value)

    def _raise_to(self, least: int) -> int:
        """The combined watermark after a scan whose least active watermark is `least` (+inf when
        every stream is idle: then the max over all), never lower than before."""
        if least == POS_INF:
            least = max(s.watermark_ns if s.closed else s.max_seen_ns for s in self.streams.values())
        if least > self._combined:
            self._combined = least
        return self._combined
