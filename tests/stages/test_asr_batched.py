"""`BatchedWhisperASR`: the batcher thread around our streaming Whisper (tiny random weights, CPU, eager).

Real transcripts through the server: `tests/serve/test_speech_stages.py` (Whisper base weights).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.observe.events import SpeechEvent, SpeechEventKind
from tristream.speech.commit import Word
from tristream.speech.config import WhisperDims, WhisperTokens
from tristream.speech.runner import WhisperRunner
from tristream.speech.streaming import StreamingWhisper
from tristream.speech.whisper import Whisper
from tristream.stages.asr_batched import BatchedWhisperASR, drop_loops
from tristream.stages.asr_batched_stream import TimedTranscript

TINY = WhisperDims(d_model=64, encoder_layers=2, decoder_layers=2, heads=4, ffn=128,
                   max_source_positions=250, max_target_positions=64)
SR = 16_000


def _build(max_streams: int = 256) -> BatchedWhisperASR:
    torch.manual_seed(0)
    model = Whisper(TINY).eval()
    runner = WhisperRunner(model, WhisperTokens.for_vocab(TINY.vocab_size), batch_buckets=(1, 2, 4),
                           audio_buckets_s=(2.0, 4.0), max_new_tokens=8, chunk=4, max_draft=4)
    return BatchedWhisperASR(StreamingWhisper(runner, lambda t: f" w{t % 7}", trim_after_s=3.0, min_update_s=0.2,
                                              max_streams=max_streams))


@pytest.fixture()
def asr() -> Any:
    a = _build()
    yield a
    a.shutdown()


def test_a_refused_open_fails_only_its_own_utterance() -> None:
    a = _build(max_streams=1)
    try:
        go = _hold(a)
        a.open("one", 0, lambda *x: None)
        a.open("two", 0, lambda *x: None)  # no audio slot left
        a.feed("one", _audio(0.5, 1))
        a.feed("two", _audio(0.5, 2))
        f1, f2 = a.finish("one"), a.finish("two")
        go.set()
        assert f1.result(30) and f2.result(30) == []
        assert a.stats.errors == 1 and "audio slots" in a.stats.last_error and a.stats.finals == 1
    finally:
        a.shutdown()


def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    return (0.3 * np.sin(2 * np.pi * (200 + 40 * seed) * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _hold(asr: BatchedWhisperASR) -> threading.Event:
    """Park the batcher thread until the returned event is set (commands queue up meanwhile)."""
    go, parked = threading.Event(), threading.Event()

    def wait() -> None:
        parked.set()
        go.wait(30)
    threading.Thread(target=asr.call, args=(wait,), daemon=True).start()
    parked.wait(30)
    return go


def test_one_pass_serves_every_stream_with_new_audio(asr: BatchedWhisperASR) -> None:
    seen: dict[str, list[str]] = {"a": [], "b": []}
    go = _hold(asr)
    for k, key in enumerate(("a", "b")):
        asr.open(key, k * 10**9, lambda c, p, dt, key=key: seen[key].append("".join(w.text for w in c)))
        asr.feed(key, _audio(0.5, k))
    go.set()
    fa, fb = asr.finish("a"), asr.finish("b")
    wa, wb = fa.result(30), fb.result(30)
    assert asr.stats.batch_sizes.get(2, 0) >= 1 and asr.stats.max_batch == 2  # one pass, both streams
    assert asr.stats.finals == 2 and asr.stats.errors == 0
    assert wa and wb and all(isinstance(w, Word) for w in wa + wb)
    assert all(10**9 <= w.start_ns <= w.end_ns <= 10**9 + SR * 10**9 // SR for w in wb)  # on b's clock
    assert asr.sw.streams == {}  # finished streams leave the model


def test_abort_frees_the_stream_without_a_final(asr: BatchedWhisperASR) -> None:
    free = len(asr.sw.store._free)
    asr.open("x", 0, lambda *a: None)
    asr.feed("x", _audio(0.3, 1))
    asr.abort("x")
    assert asr.finish("x").result(30) == []  # unknown by then: nothing to finish
    assert asr.stats.aborted == 1 and asr.stats.finals == 0
    assert len(asr.sw.store._free) == free and asr.sw.streams == {}


def test_audio_handed_over_at_once_is_trimmed_not_clipped(asr: BatchedWhisperASR) -> None:
    asr.open("m", 0, lambda *a: None)
    asr.feed("m", _audio(9.0, 2))  # more than the largest bucket (4 s)
    asr.finish("m").result(60)
    assert asr.stats.catch_up_passes >= 2  # stepped whenever past the 3 s trim length with 1 s unseen
    assert asr.sw.stats.clipped_samples == 0 and asr.sw.stats.trims >= 2  # cut between passes, never clipped


def test_a_backlog_below_the_trim_length_waits_for_one_batched_pass(asr: BatchedWhisperASR) -> None:
    go = _hold(asr)
    for key in ("p", "q", "r"):
        asr.open(key, 0, lambda *a: None)
        for _ in range(10):  # 2 s each in 200 ms chunks, queued while the batcher is busy
            asr.feed(key, _audio(0.2, 6))
    go.set()
    for key in ("p", "q", "r"):
        asr.finish(key).result(30)
    assert asr.stats.catch_up_passes == 0 and asr.stats.batch_sizes == {3: 1}  # one pass for all three


def test_a_failing_pass_fails_the_waiting_final_and_the_batcher_goes_on(asr: BatchedWhisperASR) -> None:
    real_step = asr.sw.step
    calls = {"n": 0}

    def flaky(ids: Any = None) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fault")
        return real_step(ids)
    asr.sw.step = flaky  # type: ignore[method-assign]
    go = _hold(asr)
    asr.open("f", 0, lambda *a: None)
    asr.feed("f", _audio(0.4, 3))
    fut = asr.finish("f")
    go.set()
    with pytest.raises(RuntimeError, match="device fault"):
        fut.result(30)
    assert asr.stats.errors == 1 and "device fault" in asr.stats.last_error
    assert asr.open_and_finish(_audio(0.5, 4)).result(30)  # next utterance is served


def test_session_stream_gives_partials_then_a_timed_final(asr: BatchedWhisperASR) -> None:
    s = asr.stream("sess")
    t0 = 5 * 10**9
    pcm = np.concatenate([np.zeros(SR // 2, np.float32), _audio(2.5, 5), np.zeros(SR // 2, np.float32)])
    out: list[Any] = []
    step = SR // 50
    start = SR // 2
    end = start + int(2.5 * SR)
    for i in range(0, pcm.size, step):
        s.push(pcm[i : i + step], t0 + i * 10**9 // SR)
        if i == start:
            s.push(SpeechEvent("sess", SpeechEventKind.START, t0 + 10**9 // 2, t0 + 10**9 // 2, start, 0.9))
        if i == end:
            s.push(SpeechEvent("sess", SpeechEventKind.END, t0 + 3 * 10**9, t0 + 3 * 10**9, end, 0.1))
        if i % (SR // 5) == 0:
            asr.call(lambda: None)  # let the batcher catch up, as live audio would
        out.extend(s.poll())
    out.extend(s.poll())
    finals = [t for t in out if t.final]
    partials = [t for t in out if not t.final]
    assert len(finals) == 1 and isinstance(finals[0], TimedTranscript)
    fin = finals[0]
    assert " ".join(w.text for w in fin.words) == fin.text
    # word times: reference clock inside the utterance, and the same instants in ms of the session audio
    assert all(t0 + 10**9 // 2 - 2 * 10**8 <= w.start_ns <= w.end_ns <= t0 + 3_200_000_000 for w in fin.words)
    assert all(w.start_ms == (w.start_ns - t0) // 1_000_000 for w in fin.words)
    assert all(fin.text.startswith(p.text) for p in partials)  # partials only grow (committed words)
    s.close()
    assert asr.sw.streams == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "d."]), max_size=24))
def test_drop_loops_keeps_a_prefix_without_an_immediate_repeat(keys: list[str]) -> None:
    words = [Word(k, i, i + 1) for i, k in enumerate(keys)]
    kept, cut = drop_loops(words)
    assert kept == words[: len(words) - cut]
    if cut:  # it kept one copy of a run of >= 3 words that the cut part repeats right away
        n = len(kept)
        assert any(keys[n - p : n] == keys[n : n + p] for p in range(3, n + 1))
    else:
        assert not any(keys[i : i + p] == keys[i + p : i + 2 * p]
                       for i in range(len(keys)) for p in range(3, (len(keys) - i) // 2 + 1))
