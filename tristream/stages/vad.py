"""Silero VAD as a stage: its bundled ONNX file run by onnxruntime, batched across sessions.

Why not `import silero_vad`: that import calls `torch.set_num_threads(1)` for the whole process
(see GOTCHAS.md), capping every torch model beside it. We load only the ONNX file shipped in
the `silero-vad` wheel (installed `--no-deps`) and keep the model's recurrent state and its
64-sample context per session ourselves, exactly as the reference wrapper does: each call
sees ``context(64) + window(512)`` samples at 16 kHz and returns a speech probability and the
next state (2, batch, 128).

Batching: the model takes a batch axis on both input and state, so N sessions' windows go
through one `InferenceSession.run` (`SileroVAD.run(streams)`); results equal per-session calls
(tested). A stream that runs its own windows (``batched=False``, the pipeline's way: push, then
poll at once) can still be batched: `SileroVAD.precompute` runs, in one call per round for all
streams, the windows that the samples about to be pushed will complete, from each stream's own
context and state; the stream keeps each result with the input and state it came from and uses it
in `push` only when both equal its own then (anything else pushed first: computed afresh, counted
``lookahead_mismatch``). Hysteresis follows silero's `get_speech_timestamps`: enter speech at
``p >= threshold`` once ``min_speech_ms`` of speech windows accumulated, leave below
``threshold - 0.15`` after ``min_silence_ms`` of silence (the hangover). Edges are placed on
the reference clock from the sample index (`SampleClock`), shifted by ``start_pad_ms`` /
``end_pad_ms`` measured against speech-energy edges of synthetic speech (bench/stages.py).
"""

from __future__ import annotations

import importlib.util
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tristream.observe.events import SpeechEvent, SpeechEventKind
from tristream.stages.base import BadAudio, ModelUnavailable, SampleClock, Stream, as_float_mono

__all__ = ["SileroVAD", "VADOptions", "VADStream", "silero_onnx_path"]

SAMPLE_RATE = 16_000
WINDOW = 512
CONTEXT = 64


def silero_onnx_path() -> Path:
    """Path of `silero_vad.onnx` inside the installed `silero-vad` wheel (never imported)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            "silero-vad is not installed; run `pip install --no-deps silero-vad` "
            "(only its ONNX file is used; see requirements-models.txt)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise ModelUnavailable(f"silero-vad is installed but {path} is missing; reinstall silero-vad")
    return path


@dataclass(slots=True, frozen=True)
class VADOptions:
    """Hysteresis settings; defaults follow silero's, pads calibrated on synthetic speech."""

    threshold: float = 0.5
    neg_threshold: float | None = None
    """Exit threshold; `threshold - 0.15` when None (silero's default)."""
    min_speech_ms: float = 96.0
    min_silence_ms: float = 250.0
    start_pad_ms: float = 16.0
    """Start edge = first speech window's start minus this (silero rises ~half a window late)."""
    end_pad_ms: float = -50.0
    """End edge = last window with p >= threshold, plus this (p lags speech by ~1 window)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold {self.threshold}; expected 0 < threshold < 1")
        neg = self.exit_threshold
        if not 0.0 < neg <= self.threshold:
            raise ValueError(f"neg_threshold {neg}; expected 0 < neg_threshold <= threshold")
        if self.min_speech_ms < 0 or self.min_silence_ms < 0:
            raise ValueError("min_speech_ms and min_silence_ms must be >= 0")

    @property
    def exit_threshold(self) -> float:
        """Probability below which a window counts as silence while in speech."""
        return self.neg_threshold if self.neg_threshold is not None else max(self.threshold - 0.15, 0.01)


class SileroVAD:
    """The shared silero model; one per process, any number of `VADStream`s."""

    def __init__(self, path: str | Path | None = None, threads: int = 1) -> None:
        try:
            import onnxruntime as ort
        except ImportError as e:  # pragma: no cover - dependency of tristream
            raise ModelUnavailable("onnxruntime is not installed; `pip install onnxruntime`") from e
        self.path = Path(path) if path is not None else silero_onnx_path()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3  # the file carries unused initialisers that ORT warns about
        self._session = ort.InferenceSession(str(self.path), sess_options=opts, providers=["CPUExecutionProvider"])
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)
        self.calls = 0
        self.windows = 0

    def stream(self, session_id: str, options: VADOptions | None = None, batched: bool = False) -> VADStream:
        """A new per-session stream; `batched=True` defers inference to `run([...])`."""
        return VADStream(self, session_id, options or VADOptions(), batched)

    def infer(self, x: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One ONNX call: x (N, 576) float32, state (2, N, 128) -> (probs (N,), state)."""
        out, new_state = self._session.run(None, {"input": x, "state": state, "sr": self._sr})
        self.calls += 1
        self.windows += x.shape[0]
        return np.asarray(out, dtype=np.float32).reshape(-1), np.asarray(new_state, dtype=np.float32)

    def precompute(self, pending: list[tuple[VADStream, np.ndarray]]) -> int:
        """Infer now, batched across streams, the windows that pushing each ``(stream, float32
        samples)`` will complete; each stream keeps the results for its next `push` (see the module
        docstring). Returns the number of ONNX calls made (one per round of windows)."""
        plans: list[list[Any]] = []
        for s, pcm in pending:
            s._lookahead.clear()
            if s.closed or s.batched:
                continue
            buf = np.concatenate([s._buf, pcm]) if s._buf.size else pcm
            n = int(buf.shape[0]) // WINDOW
            if n:
                plans.append([s, buf, n, s._context, s._state])
        calls = 0
        k = 0
        while True:
            ready = [p for p in plans if int(p[2]) > k]  # type: ignore[call-overload]
            if not ready:
                return calls
            x = np.empty((len(ready), CONTEXT + WINDOW), dtype=np.float32)
            state = np.empty((2, len(ready), 128), dtype=np.float32)
            for i, p in enumerate(ready):
                buf = p[1]
                assert isinstance(buf, np.ndarray)
                x[i, :CONTEXT] = p[3]
                x[i, CONTEXT:] = buf[k * WINDOW:(k + 1) * WINDOW]
                state[:, i, :] = p[4]
            probs, new_state = self.infer(x, state)
            calls += 1
            for i, p in enumerate(ready):
                s, buf = p[0], p[1]
                assert isinstance(s, VADStream) and isinstance(buf, np.ndarray)
                nxt = np.ascontiguousarray(new_state[:, i, :])
                s._lookahead.append((x[i].copy(), p[4], float(probs[i]), nxt))  # type: ignore[arg-type]
                p[3] = buf[(k + 1) * WINDOW - CONTEXT:(k + 1) * WINDOW]
                p[4] = nxt
            k += 1

    def run(self, streams: list[VADStream]) -> int:
        """Process every full window buffered in `streams`, one ONNX call per round of N.

        Returns the number of ONNX calls made.
        """
        calls = 0
        while True:
            ready = [s for s in streams if not s.closed and s.buffered >= WINDOW]
            if not ready:
                return calls
            x = np.stack([s._next_input() for s in ready])
            state = np.stack([s._state for s in ready], axis=1)
            probs, new_state = self.infer(x, state)
            calls += 1
            for i, s in enumerate(ready):
                s._accept(float(probs[i]), new_state[:, i, :])


class VADStream(Stream[np.ndarray, SpeechEvent]):
    """Per-session VAD state: samples → 512-sample windows → speech START/END events."""

    sample_rate = SAMPLE_RATE

    def __init__(self, model: SileroVAD, session_id: str, options: VADOptions, batched: bool) -> None:
        super().__init__(session_id)
        self.model = model
        self.options = options
        self.batched = batched
        self.clock = SampleClock(SAMPLE_RATE)
        self.probabilities: list[float] = []
        self.keep_probabilities = False
        self._buf = np.zeros(0, dtype=np.float32)
        self._buf_start = 0  # sample index of _buf[0]
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._state = np.zeros((2, 128), dtype=np.float32)
        self._x1 = np.zeros((1, CONTEXT + WINDOW), dtype=np.float32)
        self._lookahead: deque[tuple[np.ndarray, np.ndarray, float, np.ndarray]] = deque()
        self.precomputed = 0
        """Windows whose result came from `SileroVAD.precompute` (a batch across streams)."""
        self._speaking = False
        self._cand_start: int | None = None
        self._cand_speech = 0
        self._start_index = 0
        self._start_ns = 0
        self._temp_end: int | None = None
        self._last_speech_end = 0
        self._last_p = 0.0
        opt = options
        self._min_speech = int(opt.min_speech_ms * SAMPLE_RATE / 1000)
        self._min_silence = int(opt.min_silence_ms * SAMPLE_RATE / 1000)
        self._start_pad = int(opt.start_pad_ms * SAMPLE_RATE / 1000)
        self._end_pad = int(opt.end_pad_ms * SAMPLE_RATE / 1000)

    @property
    def buffered(self) -> int:
        """Samples waiting for inference."""
        return int(self._buf.shape[0])

    @property
    def silence_start(self) -> int | None:
        """Sample index where the silence now running inside speech began (None: no silence candidate)."""
        return self._temp_end

    @property
    def speaking(self) -> bool:
        """Whether the stream is inside a speech segment."""
        return self._speaking

    def push(self, item: np.ndarray, ref_ns: int) -> None:
        """Add 16 kHz mono samples whose first sample was captured at `ref_ns`."""
        self._check_open()
        pcm = as_float_mono(item)
        if pcm.shape[0] == 0:
            self._count("empty_chunk")
            return
        if not np.all(np.isfinite(pcm)):
            raise BadAudio(f"session {self.session_id}: audio chunk contains NaN or inf samples")
        self.clock.add(pcm.shape[0], ref_ns)
        # arrays are never written in place (only sliced and replaced), so no defensive copy
        self._buf = np.concatenate([self._buf, pcm]) if self._buf.size else pcm
        if not self.batched:
            self._run_own()

    def flush(self) -> None:
        """Pad the last partial window with zeros, run it, and close an open segment."""
        if self._closed:
            return
        rest = self.buffered % WINDOW
        if rest:
            self._count("padded_tail_samples", WINDOW - rest)
            self._buf = np.concatenate([self._buf, np.zeros(WINDOW - rest, dtype=np.float32)])
        self._run_own()
        if self._speaking:
            self._emit_end(min(self._speech_end(), self.clock.total), self._buf_start)

    def reset(self) -> None:
        """Forget the model state and any open segment (e.g. after a long gap in the audio)."""
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._state = np.zeros((2, 128), dtype=np.float32)
        self._speaking = False
        self._cand_start = None
        self._cand_speech = 0
        self._temp_end = None
        self._lookahead.clear()

    def _run_own(self) -> None:
        x = self._x1
        la = self._lookahead
        while self.buffered >= WINDOW:
            x[0, :CONTEXT] = self._context
            x[0, CONTEXT:] = self._buf[:WINDOW]
            if la:
                lx, lstate, lp, lnext = la.popleft()
                if np.array_equal(lx, x[0]) and np.array_equal(lstate, self._state):
                    self.precomputed += 1
                    self._accept(lp, lnext)
                    continue
                la.clear()
                self._count("lookahead_mismatch")
            probs, state = self.model.infer(x, self._state[:, None, :])
            self._accept(float(probs[0]), state[:, 0, :])

    def _next_input(self) -> np.ndarray:
        return np.concatenate([self._context, self._buf[:WINDOW]])

    def _accept(self, p: float, state: np.ndarray) -> None:
        self._context = self._buf[WINDOW - CONTEXT:WINDOW]
        self._state = np.ascontiguousarray(state)  # a view into a batched result is strided
        s = self._buf_start
        self._buf = self._buf[WINDOW:]
        self._buf_start += WINDOW
        self._last_p = p
        if self.keep_probabilities:
            self.probabilities.append(p)
        self._step(p, s, s + WINDOW)

    def _step(self, p: float, s: int, e: int) -> None:
        opt = self.options
        if not self._speaking:
            if p >= opt.threshold:
                if self._cand_start is None:
                    self._cand_start = s
                self._cand_speech += WINDOW
                if self._cand_speech >= self._min_speech:
                    self._speaking = True
                    self._temp_end = None
                    start = max(self._cand_start - self._start_pad, 0)
                    self._start_index = start
                    self._start_ns = self.clock.ns_at(start)
                    self._last_speech_end = e
                    self._events.append(
                        SpeechEvent(self.session_id, SpeechEventKind.START, self._start_ns,
                                    self.clock.ns_at(e), start, p)
                    )
            elif p < opt.exit_threshold and self._cand_start is not None:
                self._count("too_short_speech_candidates")
                self._cand_start = None
                self._cand_speech = 0
            return
        if p >= opt.threshold:
            self._temp_end = None
            self._last_speech_end = e
        elif p < opt.exit_threshold:
            if self._temp_end is None:
                self._temp_end = s
            if e - self._temp_end >= self._min_silence:
                self._emit_end(self._speech_end(), e)

    def _speech_end(self) -> int:
        return max(self._last_speech_end + self._end_pad, self._start_index + 1)

    def _emit_end(self, end: int, decided: int) -> None:
        self._events.append(
            SpeechEvent(self.session_id, SpeechEventKind.END, self.clock.ns_at(end),
                        self.clock.ns_at(decided), end, self._last_p, start_ns=self._start_ns)
        )
        self._speaking = False
        self._cand_start = None
        self._cand_speech = 0
        self._temp_end = None
