"""Packet types that flow through tristream, each stamped in its source's own time unit.

Every packet carries: `session_id`, `source_id`, `modality`, `ts` (source timestamp in its
native `unit`), `arrival_ns` (reference-clock ns when it reached us) and `ref_ns` (its capture
time on the reference clock, `None` until a `SourceClock` maps it).

Conventions:
- An `AudioChunk`'s `ts` is its *first* sample; its duration follows from the sample count,
  and it arrives after its *last* sample, so the clock fit pairs `src_end_ns` with arrival.
- A `SensorSample` may hold one sample (1-D values) or a block of `n` samples at `rate_hz`
  (2-D values, first sample at `ts`), like an audio chunk.
- Construction validates (finite times, positive sizes, matching rates) and raises
  `InvalidPacket`/`UnknownUnit` with an actionable message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import numpy as np

from tristream.core.errors import InvalidPacket
from tristream.core.units import MS, NS, US, TimeUnit, parse_unit

# the packet types; the time core's other names (errors, units) come from `tristream.core`
__all__ = ["AudioChunk", "ControlEvent", "Modality", "Packet", "SensorSample", "TextDelta", "VideoFrame"]


class Modality(StrEnum):
    """What kind of stream a packet belongs to."""

    AUDIO = "audio"
    VIDEO = "video"
    TEXT = "text"
    SENSOR = "sensor"
    CONTROL = "control"


def _as_unit(unit: TimeUnit | str) -> TimeUnit:
    return unit if isinstance(unit, TimeUnit) else parse_unit(unit)


def _check_arrival(kind: str, arrival_ns: int) -> None:
    if not isinstance(arrival_ns, int) or isinstance(arrival_ns, bool):
        raise InvalidPacket(f"{kind}: arrival_ns {arrival_ns!r} must be an int (reference-clock ns)")
    if arrival_ns < 0:
        raise InvalidPacket(f"{kind}: arrival_ns {arrival_ns} is negative; expected monotonic ns >= 0")


def _check_ts(kind: str, ts: int | float) -> None:
    if isinstance(ts, float) and not math.isfinite(ts):
        raise InvalidPacket(f"{kind}: timestamp {ts!r} is not finite")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise InvalidPacket(f"{kind}: timestamp {ts!r} must be an int or float in its unit")


@dataclass(slots=True, kw_only=True)
class Packet:
    """Common fields of every packet. Use a concrete subclass."""

    modality: ClassVar[Modality]

    session_id: str
    source_id: str
    ts: int | float
    unit: TimeUnit = NS
    arrival_ns: int
    ref_ns: int | None = None

    def __post_init__(self) -> None:
        self.unit = _as_unit(self.unit)
        kind = type(self).__name__
        _check_ts(kind, self.ts)
        _check_arrival(kind, self.arrival_ns)

    @property
    def src_ns(self) -> int:
        """Capture time of the first sample in source-clock nanoseconds."""
        return self.unit.to_ns(self.ts)

    @property
    def duration_ns(self) -> int:
        """How long the packet's content lasts (0 for instantaneous packets)."""
        return 0

    @property
    def src_end_ns(self) -> int:
        """Source-clock ns of the end of capture: the instant the packet could be sent."""
        return self.src_ns + self.duration_ns


@dataclass(slots=True, kw_only=True)
class AudioChunk(Packet):
    """A chunk of PCM samples; `ts` is the first sample, `pcm` is (n,) or (n, channels)."""

    modality: ClassVar[Modality] = Modality.AUDIO

    pcm: np.ndarray = field(repr=False)
    sample_rate: int

    def __post_init__(self) -> None:
        Packet.__post_init__(self)
        if not isinstance(self.sample_rate, int) or self.sample_rate <= 0:
            raise InvalidPacket(f"AudioChunk: sample_rate {self.sample_rate!r}; expected a positive int (Hz)")
        if self.unit.is_sample_index and self.unit.ticks_per_s != self.sample_rate:
            raise InvalidPacket(
                f"AudioChunk: unit {self.unit} disagrees with sample_rate {self.sample_rate}; "
                f"use samples@{self.sample_rate}"
            )
        if not isinstance(self.pcm, np.ndarray) or self.pcm.ndim not in (1, 2):
            shape = getattr(self.pcm, "shape", None)
            raise InvalidPacket(f"AudioChunk: pcm shape {shape}; expected a numpy array (n,) or (n, channels)")
        if self.pcm.shape[0] == 0:
            raise InvalidPacket("AudioChunk: pcm has 0 samples; expected at least one")

    @property
    def num_samples(self) -> int:
        """Number of samples (frames) per channel."""
        return int(self.pcm.shape[0])

    @property
    def duration_ns(self) -> int:
        return (self.num_samples * 1_000_000_000 + self.sample_rate // 2) // self.sample_rate


@dataclass(slots=True, kw_only=True)
class VideoFrame(Packet):
    """One camera frame; `image` is an HxWxC array (or encoded bytes), `ts` its PTS."""

    modality: ClassVar[Modality] = Modality.VIDEO

    image: Any = field(default=None, repr=False)
    width: int = 0
    height: int = 0
    frame_index: int = -1

    def __post_init__(self) -> None:
        Packet.__post_init__(self)
        if self.width < 0 or self.height < 0:
            raise InvalidPacket(f"VideoFrame: size {self.width}x{self.height} is negative")
        if isinstance(self.image, np.ndarray) and self.image.ndim >= 2 and self.width == 0 == self.height:
            self.height, self.width = int(self.image.shape[0]), int(self.image.shape[1])


@dataclass(slots=True, kw_only=True)
class TextDelta(Packet):
    """A piece of text (typed input or a streamed token); `ts` defaults to ms."""

    modality: ClassVar[Modality] = Modality.TEXT

    unit: TimeUnit = MS
    text: str
    final: bool = False

    def __post_init__(self) -> None:
        Packet.__post_init__(self)
        if not isinstance(self.text, str):
            raise InvalidPacket(f"TextDelta: text has type {type(self.text).__name__}; expected str")


@dataclass(slots=True, kw_only=True)
class SensorSample(Packet):
    """A sensor reading (IMU, ...): values (channels,) or a block (n, channels) at `rate_hz`."""

    modality: ClassVar[Modality] = Modality.SENSOR

    unit: TimeUnit = US
    kind: str = "imu"
    values: np.ndarray = field(repr=False)
    rate_hz: float = 0.0

    def __post_init__(self) -> None:
        Packet.__post_init__(self)
        if not isinstance(self.values, np.ndarray) or self.values.ndim not in (1, 2):
            shape = getattr(self.values, "shape", None)
            raise InvalidPacket(f"SensorSample: values shape {shape}; expected (channels,) or (n, channels)")
        if self.values.ndim == 2:
            if self.values.shape[0] == 0:
                raise InvalidPacket("SensorSample: block has 0 samples; expected at least one")
            if not (self.rate_hz > 0 and math.isfinite(self.rate_hz)):
                raise InvalidPacket(f"SensorSample: a block of samples needs rate_hz > 0, got {self.rate_hz!r}")

    @property
    def num_samples(self) -> int:
        """1 for a single reading, n for a block."""
        return 1 if self.values.ndim == 1 else int(self.values.shape[0])

    @property
    def duration_ns(self) -> int:
        if self.values.ndim == 1 or self.rate_hz <= 0:
            return 0
        return round(self.num_samples * 1e9 / self.rate_hz)


@dataclass(slots=True, kw_only=True)
class ControlEvent(Packet):
    """A control/system event (start, end_of_stream, interrupt, clock_reset, ...)."""

    modality: ClassVar[Modality] = Modality.CONTROL

    kind: str
    payload: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        Packet.__post_init__(self)
        if not self.kind:
            raise InvalidPacket("ControlEvent: kind is empty; expected e.g. 'end_of_stream' or 'interrupt'")
