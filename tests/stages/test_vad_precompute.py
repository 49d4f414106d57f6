"""`SileroVAD.precompute`: windows of many streams inferred in one batched call per round,
consumed by each stream's own `push`; events equal those of per-session calls."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from .conftest import chunks


@pytest.fixture(scope="module")
def track():
    """6 s of voiced bursts (a 120 Hz pulse train through two formant resonances, 0.3-0.9 s on,
    0.4 s off) and low noise: no TTS needed; the equality checks hold whatever the VAD decides."""

    class _T:
        rng = np.random.default_rng(7)
        n = 16000 * 6
        t = np.arange(n) / 16000
        src = (np.sin(2 * np.pi * 120 * t) > 0.97).astype(np.float32)
        x = np.zeros(n, np.float32)
        for f, bw in ((700.0, 90.0), (1200.0, 110.0)):  # two-pole resonators
            r = np.exp(-np.pi * bw / 16000)
            a1, a2 = 2 * r * np.cos(2 * np.pi * f / 16000), -r * r
            y = np.zeros(n, np.float32)
            for i in range(2, n):
                y[i] = src[i] + a1 * y[i - 1] + a2 * y[i - 2]
            x += y
        gate = np.zeros(n, np.float32)
        pos = 0
        while pos < n:
            on = int(16000 * rng.uniform(0.3, 0.9))
            gate[pos:pos + on] = 1.0
            pos += on + 6400
        pcm = (0.3 * x / np.max(np.abs(x)) * gate + 0.002 * rng.standard_normal(n)).astype(np.float32)

    return _T


def _pcms(track):
    return [track.pcm[o:] for o in (0, 3_000, 11_111, 20_000)]


def test_precompute_equals_per_session(vad, track):
    pcms = _pcms(track)
    pre = [vad.stream(f"p{i}") for i in range(len(pcms))]
    own = [vad.stream(f"o{i}") for i in range(len(pcms))]
    for s in pre + own:
        s.keep_probabilities = True
    n = 3 * 320  # three 20 ms chunks coalesced: 0-2 windows per push
    calls = 0
    for i in range(0, max(p.shape[0] for p in pcms), n):
        pairs = [(pre[k], p[i:i + n]) for k, p in enumerate(pcms) if i < p.shape[0]]
        before = vad.calls
        made = vad.precompute(pairs)
        calls += made
        for s, c in pairs:
            s.push(c, i * 62_500)
        assert vad.calls - before == made  # the pushes used the precomputed windows: no call of their own
        for k, p in enumerate(pcms):
            if i < p.shape[0]:
                own[k].push(p[i:i + n], i * 62_500)
    diffs = []
    for a, b in zip(pre, own, strict=True):
        a.flush()
        b.flush()
        assert a.counters.get("lookahead_mismatch", 0) == 0
        assert a.precomputed > 0.95 * len(a.probabilities)
        diffs.append(np.max(np.abs(np.array(a.probabilities) - np.array(b.probabilities))))
        assert [(e.kind, e.t_ns, e.sample_index) for e in a.poll()] == \
            [(e.kind, e.t_ns, e.sample_index) for e in b.poll()]
    assert max(diffs) < 1e-5, diffs  # batched ONNX vs one row: float rounding only
    windows = sum(len(s.probabilities) for s in own)
    assert calls < windows / 3


def test_a_stale_lookahead_is_recomputed(vad, track):
    """Audio pushed that the precompute did not see: the stream's own call, counted, same events."""
    pcm = track.pcm[:16000 * 4]
    a, b = vad.stream("a"), vad.stream("b")
    for i, c in chunks(pcm, 960):
        if i % (960 * 5) == 0:
            vad.precompute([(a, np.zeros(960, np.float32))])  # not what comes: a mismatch
        a.push(c, i * 62_500)
        b.push(c, i * 62_500)
    a.flush()
    b.flush()
    assert a.counters.get("lookahead_mismatch", 0) > 0
    assert [(e.kind, e.t_ns) for e in a.poll()] == [(e.kind, e.t_ns) for e in b.poll()]


def test_backend_batch_runs_one_call_per_round(vad, track):
    """`_VADBatch`: the loop turn's coalesced audio of several backends, one VAD call per round."""
    from tristream.serve.pipeline_backend import PipelineBackend, _vad_batch

    class _Session:  # the part of the pipeline `Session` the batch touches: its VAD and its input
        def __init__(self, name):
            self.vad = vad.stream(name)
            self.pushed = 0

        def push_audio(self, pcm, ref):
            self.vad.push(pcm, ref)
            self.vad.poll()
            self.pushed += pcm.shape[0]
            return True

    async def main():
        backs = []
        for k in range(8):
            b = PipelineBackend.__new__(PipelineBackend)
            b._session, b._audio_pending, b._audio_flush, b._in_vad_batch = _Session(f"s{k}"), [], None, False
            b._counters = {}
            backs.append(b)
        loop = asyncio.get_running_loop()
        before = vad.calls
        for j in range(3):  # three 20 ms chunks each, in one loop turn
            for b in backs:
                b._audio_pending.append((track.pcm[j * 320:(j + 1) * 320] + 0.0, j * 20_000_000,
                                         (j + 1) * 20_000_000))
                if not b._in_vad_batch:
                    b._in_vad_batch = True
                    _vad_batch(loop).add(b)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert all(b._session.pushed == 960 for b in backs)
        assert vad.calls - before == 1  # 8 sessions x 1 window: one call
        assert all(b._session.vad.precomputed == 1 for b in backs)

    asyncio.run(main())
