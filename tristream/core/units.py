"""Time units of source timestamps and their conversion to nanoseconds.

Sources stamp packets in their own unit (video PTS in ns, audio as a sample index, RTP in
90 kHz ticks, text in ms). A `TimeUnit` converts such a value into nanoseconds *of the
source's own clock*; mapping that onto the reference clock is `SourceClock`'s job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tristream.core.errors import InvalidPacket, UnknownUnit

NS_PER_S = 1_000_000_000

_FIXED: dict[str, tuple[str, int]] = {
    "ns": ("ns", NS_PER_S),
    "us": ("us", 1_000_000),
    "µs": ("us", 1_000_000),
    "μs": ("us", 1_000_000),
    "ms": ("ms", 1_000),
    "s": ("s", 1),
    "rtp90k": ("rtp90k", 90_000),
    "pts90k": ("pts90k", 90_000),
    "mpegts": ("pts90k", 90_000),
}
_WRAP_BITS = {"rtp90k": 32, "pts90k": 33}

UNIT_HELP = ("expected one of ns, us (µs), ms, s, samples@RATE (e.g. samples@16000), rtp90k or rtp@RATE "
             "(32-bit RTP, wraps), pts90k (33-bit MPEG-TS PTS, wraps)")


@dataclass(frozen=True, slots=True)
class TimeUnit:
    """A source time unit: `ticks_per_s` ticks make one second of the source clock.

    `name` is the canonical spelling (`"samples@16000"`, `"ms"`, ...).
    """

    name: str
    ticks_per_s: int
    wrap_bits: int = 0

    @property
    def wrap_ns(self) -> float:
        """Period after which the raw timestamp wraps, in source ns (0.0 for a unit that never wraps)."""
        return (1 << self.wrap_bits) * NS_PER_S / self.ticks_per_s if self.wrap_bits else 0.0

    @property
    def is_sample_index(self) -> bool:
        """True for `samples@RATE` and `rtp@RATE`, whose value counts samples at RATE Hz."""
        return self.name.startswith(("samples@", "rtp@"))

    def to_ns(self, value: int | float) -> int:
        """Convert a source timestamp in this unit into (source-clock) nanoseconds.

        Integers are converted exactly (rounded to the nearest ns); floats must be finite.
        """
        if isinstance(value, bool):
            raise InvalidPacket(f"timestamp {value!r} is a bool; expected a number in {self.name}")
        if isinstance(value, int):
            if self.ticks_per_s == NS_PER_S:
                return value
            num = value * NS_PER_S
            return (num + self.ticks_per_s // 2) // self.ticks_per_s
        if isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidPacket(f"timestamp {value!r} is not finite; expected a number in {self.name}")
            return round(value * (NS_PER_S / self.ticks_per_s))
        raise InvalidPacket(f"timestamp {value!r} has type {type(value).__name__}; expected int or float")

    def to_ns_array(self, values: np.ndarray) -> np.ndarray:
        """Vectorised `to_ns` for an integer array (exact, no int64 overflow before ~292 years)."""
        v = np.asarray(values, dtype=np.int64)
        rate = self.ticks_per_s
        if NS_PER_S % rate == 0:
            return v * (NS_PER_S // rate)
        whole, rest = np.divmod(v, rate)
        return whole * NS_PER_S + (rest * NS_PER_S + rate // 2) // rate

    def from_ns(self, ns: int) -> float:
        """Convert source-clock nanoseconds back into this unit (float ticks)."""
        return ns * self.ticks_per_s / NS_PER_S

    def duration_ns(self, ticks: int) -> int:
        """Duration of `ticks` ticks in nanoseconds (e.g. a chunk's sample count)."""
        if ticks < 0:
            raise InvalidPacket(f"duration of {ticks} ticks is negative; expected >= 0 {self.name}")
        return self.to_ns(ticks)

    def __str__(self) -> str:
        return self.name


@lru_cache(maxsize=256)
def parse_unit(text: str) -> TimeUnit:
    """Parse a unit string (`"ns"`, `"us"`, `"ms"`, `"s"`, `"samples@16000"`, `"rtp90k"`).

    Raises `UnknownUnit` naming the accepted spellings.
    """
    if not isinstance(text, str):
        raise UnknownUnit(f"time unit {text!r} is not a string; {UNIT_HELP}")
    key = text.strip()
    fixed = _FIXED.get(key.lower() if key not in ("µs", "μs") else key)
    if fixed is not None:
        return TimeUnit(fixed[0], fixed[1], _WRAP_BITS.get(fixed[0], 0))
    low = key.lower()
    if low.startswith(("samples@", "rtp@")):
        kind, rate_txt = low.split("@", 1)
        try:
            rate = int(rate_txt)
        except ValueError:
            raise UnknownUnit(
                f"time unit {text!r} has sample rate {rate_txt!r}; expected a positive integer, e.g. samples@16000"
            ) from None
        if rate <= 0:
            raise UnknownUnit(f"time unit {text!r} has sample rate {rate}; expected a positive integer")
        return TimeUnit(f"{kind}@{rate}", rate, 32 if kind == "rtp" else 0)
    raise UnknownUnit(f"unknown time unit {text!r}; {UNIT_HELP}")


NS = parse_unit("ns")
US = parse_unit("us")
MS = parse_unit("ms")
RTP90K = parse_unit("rtp90k")


def samples_at(rate: int) -> TimeUnit:
    """The `samples@RATE` unit for a fixed-rate stream."""
    return parse_unit(f"samples@{rate}")


class RtpUnwrapper:
    """Extends 32-bit RTP timestamps (e.g. `rtp90k`) into a monotonic 64-bit tick count.

    RTP timestamps wrap every 2**32 ticks (13.3 h at 90 kHz); each value is placed in the wrap
    cycle that puts it closest to the newest one seen, so wrap-around and reordering both work.
    """

    __slots__ = ("_newest",)

    WRAP = 1 << 32

    def __init__(self) -> None:
        self._newest: int | None = None

    def __call__(self, ts32: int) -> int:
        if not isinstance(ts32, int) or not 0 <= ts32 < self.WRAP:
            raise InvalidPacket(f"RTP timestamp {ts32!r} is not a 32-bit unsigned integer")
        if self._newest is None:
            self._newest = ts32
            return ts32
        base = self._newest - self._newest % self.WRAP
        best = min((base + ts32 + k * self.WRAP for k in (-1, 0, 1)), key=lambda v: abs(v - self._newest))  # type: ignore[operator]
        if best > self._newest:
            self._newest = best
        return best
