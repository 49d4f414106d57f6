"""The time core: packets, source clocks, time-indexed rings, watermarks, alignment, metrics.

Plain, fast, numpy-only logic (no torch, no event loop): where correctness of time lives.
"""

from __future__ import annotations

from tristream.core.align import AlignedWindow, AsOfJoin, IntervalJoin
from tristream.core.clock import ClockState, SourceClock
from tristream.core.errors import InvalidPacket, OutOfOrder, TimeCoreError, UnknownUnit
from tristream.core.metrics import DropCounter, LatencyHistogram
from tristream.core.packets import (
    AudioChunk,
    ControlEvent,
    Modality,
    Packet,
    SensorSample,
    TextDelta,
    VideoFrame,
)
from tristream.core.ring import ObjectRing, RingWindow, TimeIndexedRing
from tristream.core.sync import ApproximateTimeSync
from tristream.core.units import RtpUnwrapper, TimeUnit, parse_unit, samples_at
from tristream.core.watermark import WatermarkTracker

__all__ = [
    "AlignedWindow",
    "ApproximateTimeSync",
    "AsOfJoin",
    "ClockState",
    "IntervalJoin",
    "ObjectRing",
    "RingWindow",
    "SourceClock",
    "TimeIndexedRing",
    "WatermarkTracker",
    "AudioChunk",
    "ControlEvent",
    "DropCounter",
    "InvalidPacket",
    "LatencyHistogram",
    "Modality",
    "OutOfOrder",
    "Packet",
    "RtpUnwrapper",
    "SensorSample",
    "TextDelta",
    "TimeCoreError",
    "TimeUnit",
    "UnknownUnit",
    "VideoFrame",
    "parse_unit",
    "samples_at",
]
