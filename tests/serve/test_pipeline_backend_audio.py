"""The GPU server's microphone path: `PolyphaseResampler` (24 → 16 kHz on the event loop) and the
VAD windows of every session inferred off the loop (`pipeline_backend._VADWorker`), with the real
silero model."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from tests.signals import FORMANTS, resonate, voiced_bursts
from tristream.serve.audio import PolyphaseResampler, input_resampler
from tristream.stages.base import Resampler


def _run(r, x, step):
    return np.concatenate([r.push(x[i:i + step]) for i in range(0, x.size, step)] + [r.flush()])


def _tone(f, rate, seconds=1.0, amp=0.5):
    return (amp * np.sin(2 * np.pi * f * np.arange(int(rate * seconds)) / rate) * 32767).astype(np.int16)


def _db(err, ref):
    return 20 * np.log10(np.sqrt(np.mean(np.square(err, dtype=np.float64))) / np.sqrt(np.mean(np.square(ref, dtype=np.float64))))


@pytest.mark.parametrize("f", [200.0, 1000.0, 3000.0, 6000.0])
def test_passband_tones_come_out_aligned_and_clean(f):
    y = _run(PolyphaseResampler(24_000, 16_000), _tone(f, 24_000), 480)
    assert y.size == 16_000
    ideal = 0.5 * 32767 * np.sin(2 * np.pi * f * np.arange(y.size) / 16_000)  # no delay left
    mid = slice(500, -500)
    assert _db(y[mid] - ideal[mid], ideal[mid]) < -60


@pytest.mark.parametrize("f", [9000.0, 10_000.0, 11_500.0])
def test_stop_band_is_attenuated(f):
    y = _run(PolyphaseResampler(24_000, 16_000, dtype=np.float32), _tone(f, 24_000).astype(np.float32) / 32768, 480)
    assert 20 * np.log10(np.sqrt(np.mean(y[500:-500] ** 2)) / (0.5 / np.sqrt(2))) < -60


def test_chunking_does_not_change_the_output():
    x = (np.random.default_rng(0).standard_normal(24_000) * 3000).astype(np.int16)
    a = _run(PolyphaseResampler(24_000, 16_000), x, 480)
    b = _run(PolyphaseResampler(24_000, 16_000), x, 97)
    c = _run(PolyphaseResampler(24_000, 16_000), x, 1)
    assert a.size == b.size == c.size == 16_000
    assert np.array_equal(a, b)
    assert np.max(np.abs(a.astype(int) - c)) <= 1  # one sample a call: a vector product, rounding apart


def test_close_to_soxr_on_a_voiced_signal():
    """A 120 Hz pulse train through formant resonances (speech-like, most energy under 4 kHz)."""
    rate, n = 24_000, 48_000
    src = np.zeros(n)
    src[::rate // 120] = 1.0
    x = resonate(src, rate, (*FORMANTS, (2600.0, 160.0)))
    pcm = (0.3 * 32767 * x / np.abs(x).max()).astype(np.int16)
    ours = _run(PolyphaseResampler(rate, 16_000), pcm, 480).astype(np.float64)
    sox = _run(Resampler(rate, 16_000), pcm, 480).astype(np.float64)
    assert ours.size == sox.size
    mid = slice(800, -800)
    assert _db(ours[mid] - sox[mid], sox[mid]) < -40


@pytest.mark.parametrize(("rate_in", "rate_out"), [(48_000, 16_000), (8_000, 16_000), (32_000, 16_000), (16_000, 24_000)])
def test_other_ratios(rate_in, rate_out):
    y = _run(input_resampler(rate_in, rate_out), _tone(1000.0, rate_in), 333)
    assert isinstance(input_resampler(rate_in, rate_out), PolyphaseResampler)
    ideal = 0.5 * 32767 * np.sin(2 * np.pi * 1000 * np.arange(y.size) / rate_out)
    assert y.size == rate_out and _db(y[500:-500] - ideal[500:-500], ideal[500:-500]) < -60


def test_ratios_of_many_phases_stay_with_soxr():
    assert isinstance(input_resampler(44_100, 16_000), Resampler)
    assert isinstance(input_resampler(16_000, 16_000), Resampler)


# ---- the VAD off the event loop


def _voiced(seconds=4.0, seed=7):
    return (np.clip(voiced_bursts(seconds, seed), -1, 1) * 32767).astype(np.int16)


class _Session:
    """The part of the pipeline `Session` the backend's audio path touches: its VAD (real) and its
    audio input (the VAD run at once, as the input stage does; pushes recorded in order)."""

    def __init__(self, vad, name):
        self.vad = vad.stream(name)
        self.vad.keep_probabilities = True
        self.pushes: list[tuple[int, int]] = []
        self.events: list[tuple[str, int]] = []
        self.threads: set[int] = set()

    def push_audio(self, pcm, ref):
        self.threads.add(threading.get_ident())
        self.pushes.append((ref, pcm.shape[0]))
        self.vad.push(pcm, ref)
        self.events += [(e.kind, e.sample_index) for e in self.vad.poll()]
        return True


def _backend(vad, name):
    from tristream.serve.pipeline_backend import PipelineBackend

    class Coalescing(PipelineBackend):
        coalesce_audio = True

    b = Coalescing(None)
    b._session = _Session(vad, name)
    return b


def test_vad_windows_run_off_the_loop_batched_and_equal(vad):
    """8 sessions' 20 ms appends: each session's VAD finds every window precomputed (no model run
    on the loop), in fewer ONNX calls than windows, and the events and probabilities equal those
    of a stream that runs each window itself."""
    from tristream.serve.pipeline_backend import _vad_worker

    pcms = [_voiced(seed=k) for k in range(8)]
    backs = [_backend(vad, f"s{k}") for k in range(8)]

    async def main():
        loop = asyncio.get_running_loop()
        w = _vad_worker(loop)
        t0 = 10**12
        for i in range(0, pcms[0].size, 320):
            for b, p in zip(backs, pcms, strict=True):
                b.push_audio(p[i:i + 320], t0 + (i + 320) * 62_500, None)
            if (i // 320) % 3 == 2:  # three appends a loop turn, then the loop runs
                await asyncio.sleep(0.002)
        while w.job is not None or w.pending:
            await asyncio.sleep(0.001)
        return w

    before = vad.calls
    w = asyncio.run(main())
    made = vad.calls - before
    windows = sum(len(b._session.vad.probabilities) for b in backs)
    assert windows == 8 * (pcms[0].size // 512)
    for b, p in zip(backs, pcms, strict=True):
        s = b._session
        assert s.vad.counters.get("lookahead_mismatch", 0) == 0
        assert s.vad.precomputed == len(s.vad.probabilities)
        assert sum(n for _, n in s.pushes) == p.size
        refs = [r for r, _ in s.pushes]
        assert refs == sorted(refs)
        own = vad.stream("own")
        own.keep_probabilities = True
        ev = []
        for i in range(0, p.size, 320):
            own.push(p[i:i + 320].astype(np.float32) / 32768.0, i)
            ev += [(e.kind, e.sample_index) for e in own.poll()]
        assert ev == s.events
        assert np.max(np.abs(np.array(own.probabilities) - np.array(s.vad.probabilities))) < 1e-5
    assert made < windows / 3  # batched across sessions
    assert w.calls == made and w.unplanned == 0


def test_a_gap_splits_the_push_and_other_inputs_wait_for_the_audio(vad):
    from tristream.serve.pipeline_backend import _vad_worker

    b = _backend(vad, "g")
    pcm = _voiced(1.0)

    async def main():
        t0 = 10**12
        b.push_audio(pcm[:320], t0 + 20_000_000, None)
        b.push_audio(pcm[320:640], t0 + 40_000_000, None)
        b.push_audio(pcm[640:960], t0 + 90_000_000, None)  # 30 ms of capture time missing
        await asyncio.sleep(0)  # the job is submitted
        assert b._in_flight
        b.push_audio(pcm[960:1280], t0 + 110_000_000, None)
        b._flush_audio()  # what a text item or a commit does first: everything pushed, in order
        assert not b._in_flight and not b._audio_pending
        assert b._session.pushes == [(t0, 640), (t0 + 70_000_000, 320), (t0 + 90_000_000, 320)]
        w = _vad_worker(asyncio.get_running_loop())
        while w.job is not None:
            await asyncio.sleep(0.001)
        assert len(b._session.pushes) == 3  # the job's end pushes nothing twice

    asyncio.run(main())
    assert b._counters["audio_chunks_coalesced"] == 1
