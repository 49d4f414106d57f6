"""Batched runner and streaming ASR on a tiny random Whisper (CPU, eager; graphs are tested on GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.speech._reference import TOKENS, small_runner, tone
from tristream.speech.config import FRAME_S
from tristream.speech.mel import LogMel
from tristream.speech.streaming import NS, StreamingWhisper, tokens_to_words
from tristream.speech.whisper import Whisper


def test_greedy_pass_matches_full_sequence_reference(tiny_whisper: Whisper) -> None:
    r = small_runner(tiny_whisper)
    audio = [tone(1.3, 0), tone(1.9, 1), tone(0.4, 2)]
    res = r.run(audio)
    assert res.tokens.shape == (3, 10) and res.audio_bucket_s == 2.0 and res.batch_bucket == 4
    with torch.no_grad():
        for i, a in enumerate(audio):
            pad = np.zeros(32000, np.float32)
            pad[: a.size] = a
            enc = tiny_whisper.encode(LogMel(80)(torch.from_numpy(pad)[None]))
            seq = list(TOKENS.prompt())
            for _ in range(10):
                logits = tiny_whisper.decode_full(torch.tensor([seq]), enc)
                seq.append(int(logits[0, -1, : TOKENS.sot].argmax()))
            assert seq[len(TOKENS.prompt()):] == res.tokens[i].tolist()
    assert (res.frames >= 0).all() and (res.frames < 100).all()


def test_batched_pass_equals_one_stream_at_a_time(tiny_whisper: Whisper) -> None:
    r = small_runner(tiny_whisper)
    audio = [tone(3.0, 3), tone(4.5, 4)]
    both = r.run(audio)
    for i, a in enumerate(audio):
        one = r.run([a, np.zeros(int(4.5 * 16000), np.float32)])  # keep the same audio bucket
        np.testing.assert_array_equal(one.tokens[0], both.tokens[i])
        np.testing.assert_array_equal(one.frames[0], both.frames[i])
    assert r.stats.passes[(2, 5.0)] == 3


def test_bucket_limits_are_actionable(tiny_whisper: Whisper) -> None:
    r = small_runner(tiny_whisper)
    with pytest.raises(ValueError, match="trim"):
        r.run([tone(5.5, 0)])
    with pytest.raises(ValueError, match="split"):
        r.batch_bucket(5)


def test_tokens_to_words_groups_on_spaces_and_times_on_reference_clock() -> None:
    text = {1: " Hel", 2: "lo", 3: " world", 4: "!", 5: " again"}
    t0 = 5 * NS
    words = tokens_to_words([1, 2, 3, 4, 5, TOKENS.eot, 1], [10, 12, 30, 25, 60, 70, 80], text.__getitem__,
                            TOKENS.eot, t0, valid_frames=50)
    assert [w.text for w in words] == [" Hello", " world!", " again"]
    assert words[0].start_ns == t0 + int(10 * FRAME_S * NS)
    assert words[1].start_ns == t0 + int(30 * FRAME_S * NS)
    assert words[2].start_ns == t0 + int(49 * FRAME_S * NS)  # frames clamp to the audio and never go back
    assert all(a.start_ns <= b.start_ns for a, b in zip(words, words[1:], strict=False))


def test_streaming_many_streams_emit_timed_words(tiny_whisper: Whisper) -> None:
    r = small_runner(tiny_whisper, max_new_tokens=6)
    asr = StreamingWhisper(r, lambda t: f" w{t % 5}", min_update_s=0.32, trim_after_s=3.0, keep_s=1.0)
    starts = {"a": 1_000 * NS, "b": 2_000 * NS}
    for sid, t0 in starts.items():
        asr.open(sid, t0)
    chunk = 5120  # 320 ms
    streams = {"a": tone(4.0, 5), "b": tone(4.0, 6)}
    events = []
    for k in range(0, 64000, chunk):
        for sid, a in streams.items():
            asr.push(sid, a[k : k + chunk], starts[sid] + k * NS // 16000)
        events.extend(asr.step())
    assert asr.stats.passes == 12 and asr.stats.updates == 24  # one pass for both streams per update
    assert asr.stats.discontinuities == 0 and asr.stats.trims >= 1
    finals = {sid: asr.close(sid) for sid in list(streams)}
    assert all(f.final for f in finals.values()) and not asr.streams
    for sid, t0 in starts.items():
        mine = [w for e in events if e.stream_id == sid for w in (e.committed + e.partial)]
        mine += finals[sid].committed
        assert mine, "expected words"
        for w in mine:
            assert t0 <= w.start_ns <= w.end_ns <= t0 + 4 * NS + NS // 10
    with pytest.raises(ValueError, match="not open"):
        asr.push("zzz", np.zeros(10, np.float32))


def test_audio_store_append_trim_and_store_pass_equals_host_pass(tiny_whisper: Whisper) -> None:
    from tristream.speech.audio_store import AudioStore

    store = AudioStore(slots=3, max_samples=80000)
    a, b = tone(1.5, 7), tone(2.5, 8)
    sa, sb = store.acquire(), store.acquire()
    for k in range(0, a.size, 4000):
        store.append(sa, a[k : k + 4000])
    store.append(sb, b)
    np.testing.assert_array_equal(store.host_copy(sa), a)
    store.trim(sb, 8000)
    np.testing.assert_array_equal(store.host_copy(sb), b[8000:])
    assert float(store.buf[sb, b.size - 8000 :].abs().max()) == 0.0  # tail stays zero
    r = small_runner(tiny_whisper)
    via_store = r.run_store(store, [sa, sb])
    via_host = r.run([a, b[8000:]])
    np.testing.assert_array_equal(via_store.tokens, via_host.tokens)
    np.testing.assert_array_equal(via_store.frames, via_host.frames)
    with pytest.raises(ValueError, match="trim it first"):
        store.append(sa, np.zeros(80000, np.float32))
    store.release(sa)
    store.release(sb)
    assert store.acquire() in (sa, sb)
