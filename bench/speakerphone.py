"""A speakerphone for a live session: what the session plays comes back into its microphone.

`Speakerphone` is the session's `AudioSink`; every chunk the session plays is placed on a 16 kHz
timeline at the moment it was written, and `mic(t_ns, n)` returns that audio as a microphone
in the same room hears it: `delay_ms` later, through a room impulse response (exponential decay
with `rt60_s`, seeded noise), at `gain_db` below the played level. `converse` drives a session
in real time: microphone chunks (echo plus any user clip scheduled by the caller) every 20 ms.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RATE = 16_000
CHUNK = 320


def room_response(rt60_s: float, seed: int = 0) -> np.ndarray:
    """A unit-energy room impulse response: a direct path then decaying noise."""
    n = max(1, int(rt60_s * RATE))
    t = np.arange(n) / RATE
    rng = np.random.default_rng(seed)
    rir = rng.standard_normal(n) * np.exp(-6.9 * t / max(rt60_s, 1e-3)) * 0.3
    rir[0] = 1.0
    return (rir / np.sqrt(np.sum(rir ** 2))).astype(np.float32)


@dataclass
class Speakerphone:
    """The session's loudspeaker (an `AudioSink`) and the echo it puts into the microphone."""

    gain_db: float = -10.0
    delay_ms: float = 80.0
    rt60_s: float = 0.3
    seed: int = 0
    t0_ns: int = field(default_factory=time.monotonic_ns)
    interrupts: int = 0
    writes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rir = room_response(self.rt60_s, self.seed) * np.float32(10 ** (self.gain_db / 20))
        self.line = np.zeros(RATE * 600, dtype=np.float32)

    def write(self, pcm: np.ndarray, sample_rate: int) -> None:
        """One played chunk, placed on the timeline now."""
        from tristream.stages.base import resample

        now = time.monotonic_ns()
        x = resample(np.asarray(pcm, dtype=np.float32), sample_rate, RATE)
        i = int((now - self.t0_ns) * RATE // 1_000_000_000)
        self.line[i:i + x.shape[0]] += x[: max(0, self.line.shape[0] - i)]
        self.writes.append(now)

    def interrupt(self) -> None:
        """The session dropped what it had buffered (counted)."""
        self.interrupts += 1

    def mic(self, t_ns: int, n: int = CHUNK) -> np.ndarray:
        """The echo in the microphone samples captured from `t_ns` on."""
        k = int((t_ns - self.t0_ns) * RATE // 1_000_000_000) - int(self.delay_ms * RATE / 1000)
        m = self.rir.shape[0]
        lo = k - m + 1
        seg = np.zeros(n + m - 1, dtype=np.float32)
        a, b = max(lo, 0), max(min(k + n, self.line.shape[0]), 0)
        if b > a:
            seg[a - lo:b - lo] = self.line[a:b]
        return np.convolve(seg, self.rir, mode="valid").astype(np.float32)


async def converse(session: Any, phone: Speakerphone, seconds: float,
                   user: Callable[[int], np.ndarray | None] | None = None,
                   until: Callable[[], bool] | None = None) -> None:
    """Feed `session` a microphone in real time for up to `seconds`: echo plus what `user(t_ns)`
    returns for each 20 ms chunk (None: silence); stops early once `until()` is true."""
    t0 = time.monotonic_ns()
    k = 0
    while True:
        t = t0 + k * CHUNK * 1_000_000_000 // RATE
        delay = (t - time.monotonic_ns()) / 1e9
        if delay > 0:
            await asyncio.sleep(delay)
        chunk = phone.mic(t)
        if user is not None:
            u = user(t)
            if u is not None:
                chunk = chunk + u[:CHUNK] if u.shape[0] >= CHUNK else chunk + np.pad(u, (0, CHUNK - u.shape[0]))
        session.push_audio(chunk.astype(np.float32), t)
        k += 1
        if (t - t0) / 1e9 > seconds or (until is not None and until()):
            return


def clip_player(clip: np.ndarray, start_ns: Callable[[], int | None]) -> Callable[[int], np.ndarray | None]:
    """A `user` for `converse`: `clip` from the time `start_ns()` gives (None: not yet)."""
    def play(t_ns: int) -> np.ndarray | None:
        s = start_ns()
        if s is None or t_ns < s:
            return None
        i = int((t_ns - s) * RATE // 1_000_000_000)
        return clip[i:i + CHUNK] if i < clip.shape[0] else None
    return play
