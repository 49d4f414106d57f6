"""pocketsphinx (en-us acoustic model + generic LM from its wheel): the light ASR fallback.

It decodes incrementally as audio arrives, so the final text after VAD end costs only
`end_utt()`. Its second passes (`fwdflat`, `bestpath`) make `end_utt()` grow with utterance
length (seconds for long utterances, GOTCHAS.md), so they are off. Accuracy with the generic
LM is poor (see bench/stages.py); Whisper is the default.

One `Decoder` per session (decoders are stateful); loading one takes a fraction of a second
(the LM file is memory-mapped by the library).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from tristream.stages.asr import UtteranceStream
from tristream.stages.base import ModelUnavailable

__all__ = ["PocketsphinxASR", "PocketsphinxUtterance"]


class _Hypothesis(Protocol):
    hypstr: str


class _Decoder(Protocol):
    """What this module calls of a `pocketsphinx.Decoder`."""

    def start_utt(self) -> None: ...

    def process_raw(self, data: bytes, no_search: bool, full_utt: bool) -> None: ...

    def hyp(self) -> _Hypothesis | None: ...

    def end_utt(self) -> None: ...


class PocketsphinxASR:
    """pocketsphinx configuration shared by sessions; decoders are pooled and reused."""

    name = "pocketsphinx"

    def __init__(self, second_passes: bool = False) -> None:
        try:
            import pocketsphinx
        except ImportError as e:
            raise ModelUnavailable("pocketsphinx is not installed: `pip install pocketsphinx`") from e
        self._ps = pocketsphinx
        self.second_passes = second_passes
        self._pool: list[_Decoder] = []
        self._pool.append(self._new_decoder())  # fail at load time, not on the first utterance

    def _new_decoder(self) -> _Decoder:
        ps = self._ps
        cfg = ps.Config(fwdflat=self.second_passes, bestpath=self.second_passes, loglevel="FATAL")
        return ps.Decoder(cfg)

    def acquire(self) -> _Decoder:
        """A decoder from the pool (or a new one)."""
        return self._pool.pop() if self._pool else self._new_decoder()

    def release(self, decoder: _Decoder) -> None:
        """Return a decoder to the pool."""
        self._pool.append(decoder)

    def transcribe(self, pcm: np.ndarray) -> str:
        """Text of a whole 16 kHz clip."""
        u = self.utterance()
        u.feed(pcm)
        return u.final()

    def utterance(self) -> PocketsphinxUtterance:
        """An incremental decoder for one utterance."""
        return PocketsphinxUtterance(self)

    def stream(self, session_id: str, partial_every_s: float | None = 0.5) -> UtteranceStream:
        """A per-session ASR stream fed with audio and VAD events."""
        return UtteranceStream(self, session_id, partial_every_s=partial_every_s)


class PocketsphinxUtterance:
    """Feeds audio to the decoder as it comes; partials are free, final is `end_utt()`."""

    def __init__(self, asr: PocketsphinxASR) -> None:
        self.asr = asr
        self._dec = asr.acquire()
        self._dec.start_utt()
        self._done = False

    def feed(self, pcm: np.ndarray) -> None:
        """Decode more audio (float32 → int16 PCM)."""
        if pcm.shape[0] == 0 or self._done:
            return
        raw = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2").tobytes()
        self._dec.process_raw(raw, False, False)

    def partial(self) -> str:
        """Current best hypothesis."""
        hyp = self._dec.hyp()
        return hyp.hypstr if hyp is not None else ""

    def final(self) -> str:
        """End the utterance and return its text; the decoder goes back to the pool."""
        if self._done:
            return ""
        self._dec.end_utt()
        text = self.partial()
        self._done = True
        self.asr.release(self._dec)
        return text

    def abort(self) -> None:
        """Drop the utterance without a result; the decoder goes back to the pool."""
        if self._done:
            return
        self._dec.end_utt()
        self._done = True
        self.asr.release(self._dec)
