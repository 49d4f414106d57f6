"""PCM helpers for the serving layer: base64 pcm16 <-> numpy, and the resampling of client audio
into a session (`input_resampler`: `PolyphaseResampler` where the rates' ratio allows, else
`tristream.stages.base.Resampler`)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


def decode_pcm16(data: bytes) -> np.ndarray:
    """Little-endian int16 bytes -> int16 array (copy-free view)."""
    return np.frombuffer(data, dtype="<i2")


def encode_pcm16_b64(pcm: np.ndarray) -> str:
    """int16 array -> base64 of little-endian bytes."""
    return base64.b64encode(np.asarray(pcm, dtype="<i2").tobytes()).decode("ascii")


class PolyphaseResampler:
    """Streaming rational resampling (``rate_out / rate_in = up / down``, ``up`` at most 8) by a
    polyphase FIR in numpy, state kept across chunks: the server's 24 → 16 kHz microphone path.

    `tristream.stages.base.Resampler` (soxr) lets go of the GIL for each chunk; on the server's one
    event-loop thread every such call then waits to take it back from whichever thread holds it (up
    to the 5 ms switch interval), so its 3 µs per 20 ms chunk become hundreds under load. The matrix
    product here (one per chunk: the chunk's windows, stepped by ``down``, times the ``up`` phases)
    is small enough that numpy keeps the GIL. The filter is a Kaiser-windowed sinc at the up-sampled
    rate (`_design`: cutoff ``0.95 × min(rate_in, rate_out) / 2``, about 70 dB of stop band at the
    output's Nyquist rate); its delay is a whole number of output samples and is removed, so, like
    soxr, the output is aligned with the input and a stream's first chunk comes out shorter.
    Same interface as `Resampler` (int16 or float32 out, `push`, `flush`).
    """

    MAX_UP = 8

    def __init__(self, rate_in: int, rate_out: int, dtype: type = np.int16, delay_out: int = 24) -> None:
        from math import gcd

        if rate_in <= 0 or rate_out <= 0:
            raise ValueError(f"sample rates must be positive, got {rate_in} -> {rate_out}")
        g = gcd(rate_in, rate_out)
        self.up, self.down = rate_out // g, rate_in // g
        if self.up > self.MAX_UP:
            raise ValueError(f"{rate_in} -> {rate_out} Hz needs {self.up} phases; at most {self.MAX_UP}")
        self.rate_in, self.rate_out, self.dtype = rate_in, rate_out, np.dtype(dtype)
        self.delay_out = delay_out
        self._matrix, self._taps_per_phase = _design(self.up, self.down, delay_out)
        self._reset()

    def _reset(self) -> None:
        self._buf = np.zeros(self._taps_per_phase - 1, dtype=np.float32)  # x before the stream: zeros
        self._skip = self.delay_out  # the filter's delay, dropped from the stream's first output
        self._n_in = 0
        self._n_out = 0

    def _out(self, y: np.ndarray) -> np.ndarray:
        if self.dtype == np.int16:
            return np.clip(np.rint(y * 32768.0), -32768, 32767).astype(np.int16)
        return y.astype(np.float32, copy=False)

    def _run(self, x: np.ndarray) -> np.ndarray:
        buf = np.concatenate([self._buf, x]) if self._buf.size else x
        width = self._matrix.shape[0]
        cycles = (buf.shape[0] - width) // self.down + 1 if buf.shape[0] >= width else 0
        if cycles <= 0:
            self._buf = buf
            return np.zeros(0, np.float32)
        buf = np.ascontiguousarray(buf)
        # the cycles' windows (overlapping rows, stepped by `down`), a view: numpy's own loop runs the
        # product (such rows are no BLAS operand) and keeps the GIL
        win = np.ndarray((cycles, width), np.float32, buffer=buf, strides=(self.down * 4, 4))
        y = (win @ self._matrix).reshape(-1)
        self._buf = buf[cycles * self.down:]
        if self._skip:
            k = min(self._skip, y.shape[0])
            y, self._skip = y[k:], self._skip - k
        return y

    def push(self, pcm: np.ndarray) -> np.ndarray:
        """The resampled audio this chunk completes."""
        a = np.asarray(pcm)
        x = a.astype(np.float32) / 32768.0 if a.dtype == np.int16 else a.astype(np.float32, copy=False)
        self._n_in += x.shape[0]
        y = self._run(x.reshape(-1))
        self._n_out += y.shape[0]
        return self._out(y)

    def flush(self) -> np.ndarray:
        """The stream's remaining output (to ``len(input) × up / down`` samples in all); the
        resampler starts afresh after it."""
        want = self._n_in * self.up // self.down - self._n_out
        y = np.zeros(0, np.float32)
        if want > 0:
            pad = (self.delay_out + 2) * self.down // self.up + self._matrix.shape[0]
            y = self._run(np.zeros(pad, np.float32))[:want]
        self._reset()
        return self._out(y)


_DESIGNS: dict[tuple[int, int, int], tuple[np.ndarray, int]] = {}


def _design(up: int, down: int, delay_out: int) -> tuple[np.ndarray, int]:
    """The polyphase matrix (window width × ``up``) and the taps per phase of a Kaiser-windowed
    sinc low-pass at ``up × rate_in``, its delay ``delay_out`` output samples (``delay_out × down``
    samples at the up-sampled rate, so the filter has ``2 × delay_out × down + 1`` taps)."""
    key = (up, down, delay_out)
    got = _DESIGNS.get(key)
    if got is not None:
        return got
    center = delay_out * down
    n = 2 * center + 1
    cutoff = 0.95 * 0.5 / max(up, down)  # of the up-sampled rate: 0.95 × the lower Nyquist rate
    t = np.arange(n) - center
    h = 2 * cutoff * np.sinc(2 * cutoff * t) * np.kaiser(n, 7.0)
    taps = -(-n // up)  # per phase
    h = np.concatenate([h, np.zeros(taps * up - n)])
    phases = h.reshape(taps, up).T  # phases[r, i] = h[r + up * i]
    phases = phases / phases.sum(axis=1, keepdims=True)  # each phase passes DC at gain 1
    offsets = [k * down // up for k in range(up)]
    width = taps + offsets[-1]
    m = np.zeros((width, up), dtype=np.float64)
    for k, o in enumerate(offsets):
        r = k * down % up
        m[o:o + taps, k] = phases[r, ::-1]  # window position o + taps - 1 - i holds x[c * down + o - i]
    got = (np.ascontiguousarray(m, dtype=np.float32), taps)
    _DESIGNS[key] = got
    return got


def input_resampler(rate_in: int, rate_out: int) -> Any:
    """The resampler of a client's microphone (int16 out): `PolyphaseResampler` (it keeps the GIL:
    cheap on the event loop under load) for ratios of at most 8 phases (24, 48, 32, 8 kHz → 16 kHz),
    soxr's `Resampler` for the rest (44.1 kHz)."""
    from math import gcd

    from tristream.stages.base import Resampler

    if rate_in == rate_out or rate_out // gcd(rate_in, rate_out) > PolyphaseResampler.MAX_UP:
        return Resampler(rate_in, rate_out)
    return PolyphaseResampler(rate_in, rate_out)
