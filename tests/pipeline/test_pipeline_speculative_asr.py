"""Speculative ASR final: reused when only silence followed, dropped when the user resumed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tristream.pipeline.speculative_asr import SpeculativeRecognizer


class CountingRecognizer:
    """Text = number of samples decoded, so a test can tell which audio span was decoded."""

    name = "whisper"

    def __init__(self) -> None:
        self.transcribed: list[int] = []
        self.finals = 0

    def transcribe(self, pcm: np.ndarray) -> str:
        self.transcribed.append(int(pcm.shape[0]))
        return f"{pcm.shape[0]} samples"

    def utterance(self) -> CountingRecognizer._Utt:
        return CountingRecognizer._Utt(self)

    class _Utt:
        def __init__(self, rec: CountingRecognizer) -> None:
            self.rec = rec
            self.n = 0
            self.aborted = False

        def feed(self, pcm: np.ndarray) -> None:
            self.n += int(pcm.shape[0])

        def partial(self) -> str:
            return f"{self.n} samples"

        def final(self) -> str:
            self.rec.finals += 1
            return f"{self.n} samples"

        def abort(self) -> None:
            self.aborted = True


def _feed(u, n_chunks: int) -> None:
    for _ in range(n_chunks):
        u.feed(np.zeros(320, dtype=np.float32))


def test_speculation_is_used_when_only_silence_followed() -> None:
    inner = CountingRecognizer()
    spec = SpeculativeRecognizer(inner, max_extra_s=0.5)
    with ThreadPoolExecutor(1) as pool:
        u = spec.utterance()
        _feed(u, 50)  # 1 s of speech
        u.speculate(pool)
        _feed(u, 10)  # 200 ms more silence before the VAD's END
        assert u.final() == "16000 samples"
    assert inner.finals == 0 and u.inner.aborted
    assert (spec.started, spec.hits, spec.misses) == (1, 1, 0)


def test_dropped_or_stale_speculation_falls_back_to_a_full_decode() -> None:
    inner = CountingRecognizer()
    spec = SpeculativeRecognizer(inner, max_extra_s=0.5)
    with ThreadPoolExecutor(1) as pool:
        u = spec.utterance()
        _feed(u, 50)
        u.speculate(pool)
        u.drop()  # the user spoke again
        _feed(u, 30)
        assert u.final() == "25600 samples"
        u2 = spec.utterance()
        _feed(u2, 50)
        u2.speculate(pool)
        _feed(u2, 40)  # 0.8 s > max_extra: the speculation no longer covers the utterance
        assert u2.final() == "28800 samples"
    assert inner.finals == 2
    assert (spec.started, spec.hits, spec.misses, spec.dropped) == (2, 0, 2, 1)
