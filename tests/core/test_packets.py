from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tristream.core import (
    AudioChunk,
    ControlEvent,
    InvalidPacket,
    Modality,
    SensorSample,
    TextDelta,
    UnknownUnit,
    VideoFrame,
    parse_unit,
)


@pytest.mark.parametrize(
    ("text", "name", "rate"),
    [
        ("ns", "ns", 10**9),
        ("us", "us", 10**6),
        ("µs", "us", 10**6),
        ("ms", "ms", 1000),
        ("s", "s", 1),
        ("samples@16000", "samples@16000", 16000),
        ("rtp90k", "rtp90k", 90000),
    ],
)
def test_parse_unit(text: str, name: str, rate: int) -> None:
    u = parse_unit(text)
    assert u.name == name and u.ticks_per_s == rate


@pytest.mark.parametrize("text", ["sec", "samples@", "samples@-5", "samples@abc", "", "kHz"])
def test_unknown_unit_is_specific(text: str) -> None:
    with pytest.raises(UnknownUnit, match="unit"):
        parse_unit(text)


def test_unit_conversions() -> None:
    assert parse_unit("samples@16000").to_ns(48000) == 3_000_000_000
    assert parse_unit("rtp90k").to_ns(90) == 1_000_000
    assert parse_unit("ms").to_ns(1.5) == 1_500_000
    assert parse_unit("us").to_ns(7) == 7000
    with pytest.raises(InvalidPacket):
        parse_unit("ms").to_ns(math.nan)


@given(st.integers(min_value=0, max_value=10**12), st.sampled_from(["us", "ms", "samples@48000", "rtp90k"]))
def test_unit_roundtrip(ticks: int, unit: str) -> None:
    u = parse_unit(unit)
    assert abs(u.from_ns(u.to_ns(ticks)) - ticks) <= 0.5 * u.ticks_per_s / 1e9 + 1e-6 * max(1, ticks) * 1e-6


def test_audio_chunk_duration_and_end() -> None:
    a = AudioChunk(
        session_id="s", source_id="mic0", ts=48000, unit="samples@16000", arrival_ns=5,  # type: ignore[arg-type]
        pcm=np.zeros(320, np.float32), sample_rate=16000,
    )
    assert a.modality is Modality.AUDIO
    assert a.src_ns == 3_000_000_000
    assert a.duration_ns == 20_000_000
    assert a.src_end_ns == 3_020_000_000
    assert a.ref_ns is None
    assert not hasattr(a, "__dict__")  # slots


def test_audio_chunk_rejects_bad_input() -> None:
    with pytest.raises(InvalidPacket, match="samples@16000"):
        AudioChunk(session_id="s", source_id="m", ts=0, unit="samples@8000", arrival_ns=0,  # type: ignore[arg-type]
                   pcm=np.zeros(10), sample_rate=16000)
    with pytest.raises(InvalidPacket, match="0 samples"):
        AudioChunk(session_id="s", source_id="m", ts=0, arrival_ns=0, pcm=np.zeros(0), sample_rate=16000)
    with pytest.raises(InvalidPacket, match="negative"):
        AudioChunk(session_id="s", source_id="m", ts=0, arrival_ns=-1, pcm=np.zeros(3), sample_rate=16000)
    with pytest.raises(InvalidPacket, match="finite"):
        AudioChunk(session_id="s", source_id="m", ts=math.nan, arrival_ns=0, pcm=np.zeros(3), sample_rate=16000)
    with pytest.raises(UnknownUnit):
        AudioChunk(session_id="s", source_id="m", ts=0, unit="bogus", arrival_ns=0, pcm=np.zeros(3),  # type: ignore[arg-type]
                   sample_rate=16000)


def test_other_packets() -> None:
    f = VideoFrame(session_id="s", source_id="cam0", ts=33_000_000, arrival_ns=1, image=np.zeros((4, 6, 3)))
    assert (f.width, f.height) == (6, 4) and f.modality is Modality.VIDEO and f.duration_ns == 0
    t = TextDelta(session_id="s", source_id="kbd", ts=12, arrival_ns=1, text="hi")
    assert t.src_ns == 12_000_000 and t.modality is Modality.TEXT
    imu = SensorSample(session_id="s", source_id="imu0", ts=1000, arrival_ns=1, values=np.zeros((10, 6)),
                       rate_hz=200.0)
    assert imu.num_samples == 10 and imu.duration_ns == 50_000_000 and imu.src_ns == 1_000_000
    with pytest.raises(InvalidPacket, match="rate_hz"):
        SensorSample(session_id="s", source_id="imu0", ts=0, arrival_ns=1, values=np.zeros((10, 6)))
    c = ControlEvent(session_id="s", source_id="sys", ts=0, arrival_ns=0, kind="end_of_stream")
    assert c.modality is Modality.CONTROL
    with pytest.raises(InvalidPacket):
        ControlEvent(session_id="s", source_id="sys", ts=0, arrival_ns=0, kind="")
    with pytest.raises(InvalidPacket, match="negative"):
        VideoFrame(session_id="s", source_id="c", ts=0, arrival_ns=0, width=-1)


def test_rtp_unwrapper() -> None:
    from tristream.core.units import RtpUnwrapper

    u = RtpUnwrapper()
    wrap = 1 << 32
    seq = [wrap - 3000, wrap - 1500, 10, 5, 1510, 3010]  # wrap-around, then one reordered packet
    assert [u(v) for v in seq] == [wrap - 3000, wrap - 1500, wrap + 10, wrap + 5, wrap + 1510, wrap + 3010]
    with pytest.raises(InvalidPacket):
        u(-1)
