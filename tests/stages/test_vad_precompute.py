"""`SileroVAD.precompute`: windows of many streams inferred in one batched call per round,
consumed by each stream's own `push`; events equal those of per-session calls."""

from __future__ import annotations

import numpy as np
import pytest

from tests.signals import voiced_bursts

from .conftest import chunks


@pytest.fixture(scope="module")
def track():
    """6 s of voiced bursts (a 120 Hz pulse train through two formant resonances, 0.3-0.9 s on,
    0.4 s off) and low noise: no TTS needed; the equality checks hold whatever the VAD decides."""

    class _T:
        pcm = voiced_bursts(6.0).astype(np.float32)

    return _T


def _pcms(track):
    return [track.pcm[o:] for o in (0, 3_000, 11_111, 20_000)]


def _precompute(vad, pairs):
    """What the server's VAD job does: plan on the loop, infer (here inline), hand the results back."""
    planned = [(s, *s.plan(True), pcm) for s, pcm in pairs]
    planned = [(s, plan, gen, pcm) for s, plan, gen, pcm in planned if plan is not None]
    results, calls = vad.precompute([(plan, pcm) for _, plan, _, pcm in planned])
    for (s, _, gen, _), (windows, plan) in zip(planned, results, strict=True):
        assert s.take_precomputed(gen, windows, plan)
    return calls


def test_precompute_equals_per_session(vad, track):
    pcms = _pcms(track)
    pre = [vad.stream(f"p{i}") for i in range(len(pcms))]
    own = [vad.stream(f"o{i}") for i in range(len(pcms))]
    for s in pre + own:
        s.keep_probabilities = True
    n = 3 * 320  # three 20 ms chunks coalesced: 0-2 windows per push
    calls = 0
    for i in range(0, max(p.shape[0] for p in pcms), 2 * n):
        # two jobs planned before either is pushed: the second goes on from the first's plan
        for h in (0, n):
            pairs = [(pre[k], p[i + h:i + h + n]) for k, p in enumerate(pcms) if i + h < p.shape[0]]
            calls += _precompute(vad, pairs)
        before = vad.calls
        for h in (0, n):
            for k, p in enumerate(pcms):
                if i + h < p.shape[0]:
                    pre[k].push(p[i + h:i + h + n], (i + h) * 62_500)
        assert vad.calls == before  # the pushes used the precomputed windows: no call of their own
        for h in (0, n):
            for k, p in enumerate(pcms):
                if i + h < p.shape[0]:
                    own[k].push(p[i + h:i + h + n], (i + h) * 62_500)
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


def test_pushes_use_the_precomputed_windows(vad, track):
    """A precomputed stream's pushes run no model call of their own."""
    s = vad.stream("x")
    pcm = track.pcm[:16000 * 2]
    for i in range(0, pcm.shape[0], 960):
        _precompute(vad, [(s, pcm[i:i + 960])])
        before = vad.calls
        s.push(pcm[i:i + 960], i * 62_500)
        assert vad.calls == before
    assert s.precomputed == pcm.shape[0] // 512


def test_a_stale_lookahead_is_recomputed_and_the_plan_starts_again(vad, track):
    """Audio pushed that the precompute did not see: the stream's own call, counted, same events;
    the next plan starts from the stream's own state (once caught up) and is used again."""
    pcm = track.pcm[:16000 * 4]
    a, b = vad.stream("a"), vad.stream("b")
    late = 0
    for i, c in chunks(pcm, 960):
        if i % (960 * 5) == 0:
            _precompute(vad, [(a, np.zeros(960, np.float32))])  # not what comes: a mismatch
        elif i % (960 * 5) == 960 * 2:
            got = a.precomputed
            _precompute(vad, [(a, c)])
            late += 1
        a.push(c, i * 62_500)
        b.push(c, i * 62_500)
        if i % (960 * 5) == 960 * 2:
            assert a.precomputed > got
    a.flush()
    b.flush()
    assert late and a.counters.get("lookahead_mismatch", 0) > 0
    assert [(e.kind, e.t_ns) for e in a.poll()] == [(e.kind, e.t_ns) for e in b.poll()]


def test_a_dropped_plan_refuses_results_planned_before(vad, track):
    s = vad.stream("d")
    plan, gen = s.plan(True)
    results, _ = vad.precompute([(plan, track.pcm[:1024])])
    s.reset()  # the plan is dropped meanwhile
    assert not s.take_precomputed(gen, *results[0])
    plan2, gen2 = s.plan(False)
    assert plan2 is None and gen2 != gen  # not caught up: nothing to plan from
