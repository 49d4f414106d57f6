from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.observe.events import SpeechEventKind
from tristream.stages.base import BadAudio, StageClosed
from tristream.stages.vad import VADOptions

from .conftest import chunks

T0 = 5_000_000_000  # reference clock of the first sample


def _run(vad, pcm, chunk=320, t0=T0, options=None):
    s = vad.stream("s", options)
    for i, c in chunks(pcm, chunk):
        s.push(c, t0 + i * 1_000_000_000 // 16000)
    s.flush()
    return s, s.poll()


def test_vad_finds_segments_within_50ms(vad, track):
    s, events = _run(vad, track.pcm)
    starts = [e for e in events if e.kind == SpeechEventKind.START]
    ends = [e for e in events if e.kind == SpeechEventKind.END]
    assert len(starts) == len(ends) == len(track.segments)
    for seg, a, b in zip(track.segments, starts, ends, strict=True):
        true_start = T0 + seg.start * 1_000_000_000 // 16000
        true_end = T0 + seg.end * 1_000_000_000 // 16000
        assert abs(a.t_ns - true_start) <= 50_000_000, (seg.text, (a.t_ns - true_start) / 1e6)
        assert abs(b.t_ns - true_end) <= 50_000_000, (seg.text, (b.t_ns - true_end) / 1e6)
        assert b.start_ns == a.t_ns
        # a decision can only come after the audio that shows it
        assert a.decided_ns >= a.t_ns and b.decided_ns >= b.t_ns


def test_events_follow_chunk_ref_times_across_a_clock_jump(vad, track):
    """Edges are placed from each chunk's own ref time, not from a running sample count."""
    jump = 37_000_000
    s = vad.stream("j")
    for i, c in chunks(track.pcm, 320):
        s.push(c, T0 + i * 1_000_000_000 // 16000 + (jump if i >= 16000 * 2 else 0))
    s.flush()
    shifted = s.poll()
    _, plain = _run(vad, track.pcm)
    for a, b in zip(plain, shifted, strict=True):
        expect = jump if a.sample_index >= 16000 * 2 else 0
        assert b.t_ns - a.t_ns == expect


def test_batched_equals_per_session(vad, track):
    offsets = [0, 3_000, 11_111, 20_000]
    pcms = [track.pcm[o:] for o in offsets]
    batched = [vad.stream(f"b{i}", batched=True) for i in range(len(pcms))]
    single = [vad.stream(f"s{i}") for i in range(len(pcms))]
    for s in batched + single:
        s.keep_probabilities = True
    calls_before = vad.calls
    n = 480
    for i in range(0, max(p.shape[0] for p in pcms), n):
        for k, p in enumerate(pcms):
            if i < p.shape[0]:
                batched[k].push(p[i:i + n], i * 62_500)
                single[k].push(p[i:i + n], i * 62_500)
        vad.run(batched)
    batched_calls = vad.calls - calls_before
    for b, s in zip(batched, single, strict=True):
        b.flush()
        s.flush()
        assert np.allclose(b.probabilities, s.probabilities, atol=1e-5)
        assert [(e.kind, e.t_ns) for e in b.poll()] == [(e.kind, e.t_ns) for e in s.poll()]
    # one ONNX call per round serves all sessions (plus the per-session calls of `single`)
    windows = sum(len(s.probabilities) for s in single)
    assert batched_calls < windows * 2 - windows // 2


@settings(max_examples=12, deadline=None)
@given(chunk=st.integers(min_value=1, max_value=4000))
def test_chunking_does_not_change_events(vad, track, chunk):
    pcm = track.pcm[: 16000 * 5]
    _, ref = _run(vad, pcm, chunk=512)
    _, got = _run(vad, pcm, chunk=chunk)
    assert [(e.kind, e.t_ns) for e in got] == [(e.kind, e.t_ns) for e in ref]
    assert len(ref) >= 2


def test_silence_gives_no_events_and_short_blips_are_counted(vad):
    rng = np.random.default_rng(1)
    s, events = _run(vad, (rng.normal(0, 1e-3, 16000 * 2)).astype(np.float32))
    assert events == []
    assert s.counters.get("padded_tail_samples", 0) > 0


def test_int16_input_equals_float(vad, track):
    pcm = track.pcm[: 16000 * 4]
    _, f = _run(vad, pcm)
    _, i = _run(vad, (pcm * 32767).astype(np.int16))
    assert [(e.kind, e.t_ns) for e in f] == [(e.kind, e.t_ns) for e in i]


def test_bad_input_and_closed_stream(vad):
    s = vad.stream("x")
    with pytest.raises(BadAudio, match="NaN"):
        s.push(np.array([0.0, np.nan], dtype=np.float32), 0)
    with pytest.raises(BadAudio, match="dtype"):
        s.push(np.zeros(10, dtype=np.int64), 0)
    s.close()
    with pytest.raises(StageClosed):
        s.push(np.zeros(10, dtype=np.float32), 0)
    with pytest.raises(ValueError, match="threshold"):
        VADOptions(threshold=1.5)
