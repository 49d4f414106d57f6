"""Echo of the assistant's own voice: never taken for the user (reference-aware gating).

On a speakerphone the microphone hears the answer the session is playing. The session knows
exactly what it played and when (`play`), so each 20 ms microphone block can be compared with
the audio that was playing around the time it was captured:

- the *echo ratio* of a block is its energy over that of the loudest block played in the last
  600 ms (an echo path's delay plus its reverberation);
- the echo's own ratio is learnt from the blocks the gate attributes to echo (the loudest
  ratio of the last second of them, 90th percentile; a silent microphone, as with a headset, teaches a low one);
  for the first 300 ms of playback an echo is assumed no louder than what plays (a speakerphone's echo is quieter than its loudspeaker, a user close to the
  microphone louder);
- a block holds the user's voice (`user_present`) when its ratio is `margin_db` above the
  echo's. `recent_user` asks that of most of the last 160 ms: barge-in during playback requires
  it, so speech the echo explains never interrupts the answer.

While nothing plays, every block counts as the user's. An adaptive echo canceller (a
partitioned-block NLMS filter) was tried first and not kept: within a session's short answers,
split into TTS pieces, it did not converge (`docs/assistant.md`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from tristream.stages.base import resample

__all__ = ["EchoGate", "EchoStats"]

RATE = 16_000


@dataclass(slots=True)
class EchoStats:
    """Counters of one session's echo gate."""

    blocks: int = 0
    blocks_with_reference: int = 0
    blocks_user_present: int = 0


class EchoGate:
    """Per-session echo gate over the audio the session played (16 kHz mono blocks)."""

    def __init__(self, block: int = 320, margin_db: float = 6.0, history_s: float = 4.0,
                 window_ms: float = 600.0) -> None:
        self.n = block
        self.margin = 10 ** (margin_db / 10)
        self._ref = np.zeros(int(history_s * RATE), dtype=np.float32)
        self._ref_end = 0  # absolute 16 kHz sample index one past the last played sample
        self._t0_ns: int | None = None  # reference time of absolute sample 0
        self._pending = np.zeros(0, dtype=np.float32)
        self._pending_ns = 0
        self._ref_energy: deque[float] = deque(maxlen=max(1, int(window_ms * RATE / 1000 / block)))
        self._ratios: deque[float] = deque(maxlen=50)  # echo blocks' ratios, 1 s
        self._recent: deque[bool] = deque(maxlen=8)  # user presence of the last 160 ms
        self.stats = EchoStats()

    # ---- the played reference ----------------------------------------------------------
    def play(self, pcm: np.ndarray, sample_rate: int, t_ns: int) -> None:
        """`pcm` started playing at `t_ns` (the session clock)."""
        x = resample(np.asarray(pcm, dtype=np.float32), sample_rate, RATE)
        if self._t0_ns is None:
            self._t0_ns = t_ns
        start = max(self._index(t_ns), self._ref_end)  # playout runs a hair early: stay contiguous
        size = self._ref.shape[0]
        if x.shape[0] > size:  # only the newest `history_s` can still be needed
            start, x = start + x.shape[0] - size, x[-size:]
        if start > self._ref_end:  # silence between pieces
            gap = min(start - self._ref_end, size)
            self._fill(start - gap, np.zeros(gap, dtype=np.float32))
        self._fill(start, x)
        self._ref_end = start + x.shape[0]

    def _index(self, t_ns: int) -> int:
        assert self._t0_ns is not None
        return int((t_ns - self._t0_ns) * RATE // 1_000_000_000)

    def _fill(self, start: int, x: np.ndarray) -> None:
        self._ref[(start + np.arange(x.shape[0])) % self._ref.shape[0]] = x

    def _reference(self, start: int, n: int) -> np.ndarray:
        """Played samples [start, start+n) (zeros where nothing played or already overwritten)."""
        out = np.zeros(n, dtype=np.float32)
        lo, hi = max(start, self._ref_end - self._ref.shape[0]), min(start + n, self._ref_end)
        if hi > lo:
            out[lo - start:hi - start] = self._ref[np.arange(lo, hi) % self._ref.shape[0]]
        return out

    # ---- the microphone ----------------------------------------------------------------
    def process(self, pcm: np.ndarray, ref_ns: int) -> np.ndarray:
        """Judge one microphone chunk captured from `ref_ns`; returns it unchanged."""
        pcm = np.asarray(pcm, dtype=np.float32)
        if self._t0_ns is None:  # nothing played yet
            return pcm
        if not self._pending.size:
            self._pending_ns = ref_ns
        self._pending = np.concatenate([self._pending, pcm])
        while self._pending.shape[0] >= self.n:
            d, self._pending = self._pending[:self.n], self._pending[self.n:]
            self._recent.append(self._block(d, self._index(self._pending_ns)))
            self._pending_ns += self.n * 1_000_000_000 // RATE
        return pcm

    def recent_user(self, share: float = 0.6) -> bool:
        """Whether the user's voice, not the echo, holds at least `share` of the last 160 ms
        (True while nothing plays: there is no echo to mistake for the user)."""
        if not self._recent:
            return True
        return sum(self._recent) >= share * len(self._recent)

    def _block(self, d: np.ndarray, start: int) -> bool:
        st = self.stats
        st.blocks += 1
        x = self._reference(start, self.n)
        self._ref_energy.append(float(x @ x) / self.n)
        loudest = max(self._ref_energy)
        if loudest <= 1e-7:
            return True
        st.blocks_with_reference += 1
        ed = float(d @ d) / self.n
        ratio = ed / loudest
        known = len(self._ratios) >= 15  # 300 ms of playback: past any echo path's delay
        typical = float(np.percentile(self._ratios, 90)) if known else 1.0 / self.margin
        present = ed > 1e-6 and ratio > self.margin * typical
        if not present or not known:  # the echo's level (silence too: a headset has no echo)
            self._ratios.append(ratio)
        st.blocks_user_present += present
        return present
