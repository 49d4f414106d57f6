"""The echo gate and the streaming ASR's agreement rules, without models."""

from __future__ import annotations

import numpy as np

from tristream.stages.asr_stream import _cut_loops, local_agreement
from tristream.stages.echo import EchoGate

RATE = 16_000
BLOCK = 320


def _speechlike(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * RATE)
    env = np.abs(np.sin(np.arange(n) / RATE * 2 * np.pi * 3.0)) + 0.1  # syllable-rate envelope
    return (0.2 * env * rng.standard_normal(n)).astype(np.float32)


def _run(gate: EchoGate, played: np.ndarray, mic: np.ndarray) -> list[bool]:
    t0 = 1_000_000_000
    out = []
    for i in range(0, mic.shape[0], BLOCK):
        t = t0 + i * 1_000_000_000 // RATE
        gate.play(played[i:i + BLOCK], RATE, t)
        gate.process(mic[i:i + BLOCK], t)
        out.append(gate.recent_user())
    return out


def _echo(x: np.ndarray, gain_db: float, delay_ms: float) -> np.ndarray:
    d = int(delay_ms * RATE / 1000)
    tail = np.exp(-np.arange(int(0.2 * RATE)) / (0.04 * RATE)).astype(np.float32)
    tail /= np.sqrt(np.sum(tail ** 2))
    y = np.convolve(x, tail)[: x.shape[0]]
    return (np.concatenate([np.zeros(d, np.float32), y])[: x.shape[0]] * 10 ** (gain_db / 20)).astype(np.float32)


def test_the_echo_of_what_plays_is_never_the_user() -> None:
    for gain, delay in ((-6.0, 20.0), (-12.0, 80.0), (-20.0, 150.0)):
        played = _speechlike(4.0, 1)
        verdicts = _run(EchoGate(), played, _echo(played, gain, delay))
        assert not any(verdicts[20:]), (gain, delay)  # after the first 400 ms of playback


def test_the_user_over_the_echo_is_heard() -> None:
    played = _speechlike(4.0, 1)
    mic = _echo(played, -12.0, 80.0)
    user = _speechlike(1.0, 2) * 2.0
    mic[2 * RATE:3 * RATE] += user
    verdicts = _run(EchoGate(), played, mic)
    during = verdicts[2 * RATE // BLOCK + 8: 3 * RATE // BLOCK]
    assert sum(during) >= 0.8 * len(during)
    assert not any(verdicts[3 * RATE // BLOCK + 12:])  # and the echo alone again after


def test_nothing_playing_means_no_echo_to_mistake() -> None:
    gate = EchoGate()
    gate.process(_speechlike(0.5, 3), 0)
    assert gate.recent_user()


def test_local_agreement_and_loop_cutting() -> None:
    assert local_agreement([" Please", " turn", " on", "."], [" please", " turn", " off"]) == 2
    assert local_agreement([" a", "."], [" a", "."]) == 2  # punctuation compares as itself
    words = [(w, [i]) for i, w in enumerate([" the", " weather", " weather", " weather", " is"])]
    assert [w for w, _ in _cut_loops(words)] == [" the", " weather"]
    looped = [(w, [i]) for i, w in enumerate([" Tell", " me", " a", " story", ".", " Tell", " me", " a"])]
    assert [w for w, _ in _cut_loops(looped)] == [" Tell", " me", " a", " story", "."]  # re-reading its window
    ahead = [(w, [i]) for i, w in enumerate([" Tell", " me", " a"])]
    assert _cut_loops(ahead, [" Tell", " me", " a", " story", "."]) == []  # a committed sentence again


def test_decode_batches_hold_one_job_per_utterance_and_skip_cancelled_ones() -> None:
    """The decode thread's batching rule, with a decode that records its batches."""
    import threading
    import time

    from tristream.stages.asr_stream import _Decode, _Worker
    from tristream.stages.asr_whisper import DecodeRequest, DecodeResult

    gate = threading.Event()
    seen: list[list[int]] = []

    def decode(reqs: list[DecodeRequest]) -> list[DecodeResult]:
        gate.wait(5)
        seen.append([r.max_new for r in reqs])
        return [DecodeResult(r, [r.max_new], None, i, 0) for i, r in enumerate(reqs)]

    def job(key: int, tag: int) -> _Decode:
        return _Decode(key, lambda: DecodeRequest(np.zeros(1, np.float32), [], [], tag),
                       lambda res: res.tokens[0] if res is not None else None)

    worker = _Worker("test-decode", decode, max_batch=3)
    first = worker.submit(1, job(0, 0))  # occupies the thread until the gate opens
    time.sleep(0.05)
    futs = [worker.submit(1, job(1, 1)), worker.submit(1, job(1, 2)), worker.submit(0, job(2, 3)),
            worker.submit(1, job(3, 4)), worker.submit(1, job(4, 5))]
    futs[4].cancel()
    gate.set()
    assert [f.result(5) for f in futs[:4]] == [1, 2, 3, 4] and first.result(5) == 0
    assert seen[0] == [0]
    assert seen[1] == [3]  # a final batches with finals only
    assert seen[2] == [1, 4]  # utterance 1's second job waits; the cancelled one never runs
    assert seen[3] == [2]


def test_decode_batches_hold_buffers_of_similar_length() -> None:
    """Buffers of very different lengths decode in separate batches (padding a short one with
    seconds of silence costs accuracy and encoder time)."""
    from tristream.stages.asr_stream import _Decode, run_batch
    from tristream.stages.asr_whisper import DecodeRequest, DecodeResult

    seen: list[list[float]] = []

    def decode(reqs: list[DecodeRequest]) -> list[DecodeResult]:
        seen.append(sorted(r.pcm.shape[0] / 16_000 for r in reqs))
        return [DecodeResult(r, [r.pcm.shape[0]], None, i, 0) for i, r in enumerate(reqs)]

    def job(seconds: float):
        import concurrent.futures

        pcm = np.zeros(int(seconds * 16_000), np.float32)
        d = _Decode(id(pcm), lambda: DecodeRequest(pcm, [], [], 8),
                    lambda res: res.tokens[0] if res is not None else None)
        return (1, 0, d, concurrent.futures.Future())

    batch = [job(s) for s in (12.0, 2.0, 3.0, 11.0)]
    run_batch(batch, decode)
    assert seen == [[2.0, 3.0], [11.0, 12.0]]  # 2 s with 3 s, 11 s with 12 s; never 2 s with 12 s
    assert [f.result(1) for *_, f in batch] == [192_000, 32_000, 48_000, 176_000]  # each its own result
