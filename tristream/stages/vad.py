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
poll at once) can still be batched, ahead of its pushes: `SileroVAD.precompute` infers, in one call
per round for all streams, the windows that the samples about to be pushed will complete, from each
stream's `VADPlan` (its buffer, context and state once the audio precomputed before is pushed). It
reads only its arguments, so it runs in a worker thread (ONNX Runtime lets go of the GIL while it
runs); the caller hands each result back with `VADStream.take_precomputed` and pushes the samples
after it. The stream keeps each result with the input and state it came from and uses it in `push`
only when both equal its own then (anything else pushed first, or audio dropped before it: computed
afresh, counted ``lookahead_mismatch``, and the plan starts again from the stream's own state).
Hysteresis follows silero's `get_speech_timestamps`: enter speech at
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

import numpy as np

from tristream.observe.events import SpeechEvent, SpeechEventKind
from tristream.stages.base import BadAudio, ModelUnavailable, SampleClock, Stream, as_float_mono

__all__ = ["SileroVAD", "VADOptions", "VADPlan", "VADStream", "silero_onnx_path"]

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


@dataclass(slots=True, frozen=True)
class VADPlan:
    """Where a stream's precomputed windows go on from: the samples short of a window, the model's
    64-sample context and state, once the audio precomputed so far has been pushed (arrays are
    never written in place, so the stream's own may be shared)."""

    buf: np.ndarray
    context: np.ndarray
    state: np.ndarray


Lookahead = tuple[np.ndarray, np.ndarray, float, np.ndarray]
"""One precomputed window: its input (context + window), the state before, the probability, the state after."""


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

    def precompute(self, jobs: list[tuple[VADPlan, np.ndarray]]) -> tuple[list[tuple[list[Lookahead], VADPlan]], int]:
        """Infer, batched across jobs, the windows that pushing each job's float32 samples onto its
        plan completes. Reads only its arguments (any thread). Returns per job the windows
        (`Lookahead`) and the plan after them, and the number of ONNX calls (one per round)."""
        bufs = [np.concatenate([p.buf, pcm]) if p.buf.size else pcm for p, pcm in jobs]
        counts = [int(b.shape[0]) // WINDOW for b in bufs]
        ctx = [p.context for p, _ in jobs]
        st = [p.state for p, _ in jobs]
        out: list[list[Lookahead]] = [[] for _ in jobs]
        calls = 0
        k = 0
        while True:
            ready = [j for j, n in enumerate(counts) if n > k]
            if not ready:
                break
            x = np.empty((len(ready), CONTEXT + WINDOW), dtype=np.float32)
            state = np.empty((2, len(ready), 128), dtype=np.float32)
            for i, j in enumerate(ready):
                x[i, :CONTEXT] = ctx[j]
                x[i, CONTEXT:] = bufs[j][k * WINDOW:(k + 1) * WINDOW]
                state[:, i, :] = st[j]
            probs, new_state = self.infer(x, state)
            calls += 1
            for i, j in enumerate(ready):
                nxt = np.ascontiguousarray(new_state[:, i, :])
                out[j].append((x[i].copy(), st[j], float(probs[i]), nxt))
                ctx[j] = bufs[j][(k + 1) * WINDOW - CONTEXT:(k + 1) * WINDOW]
                st[j] = nxt
            k += 1
        return [(la, VADPlan(b[n * WINDOW:], c, s_)) for la, b, n, c, s_ in zip(out, bufs, counts, ctx, st,
                                                                                 strict=True)], calls

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
        self._lookahead: deque[Lookahead] = deque()
        self._plan: VADPlan | None = None
        self._plan_gen = 0  # moves when the plan is dropped: results planned before it are stale
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

    def plan(self, caught_up: bool) -> tuple[VADPlan | None, int]:
        """Where the next `SileroVAD.precompute` for this stream starts, and the plan's generation
        (for `take_precomputed`): the plan after the audio precomputed so far; without one (a new
        stream, or one whose lookahead failed), the stream's own state if ``caught_up`` (every
        sample pushed to it before has been pushed), else None (nothing to plan from)."""
        if self._plan is None and caught_up and not self._closed:
            self._lookahead.clear()
            self._plan = VADPlan(self._buf, self._context, self._state)
        return self._plan, self._plan_gen

    def take_precomputed(self, gen: int, windows: list[Lookahead], plan: VADPlan) -> bool:
        """Keep the windows that `SileroVAD.precompute` computed from the plan of generation ``gen``
        for the next pushes; False (dropped) when the plan was dropped since."""
        if gen != self._plan_gen or self._plan is None:
            return False
        self._lookahead.extend(windows)
        self._plan = plan
        return True

    def _drop_plan(self) -> None:
        self._lookahead.clear()
        self._plan = None
        self._plan_gen += 1

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
        self._drop_plan()
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
        self._drop_plan()

    def _run_own(self) -> None:
        x = self._x1
        la = self._lookahead
        while self.buffered >= WINDOW:
            x[0, :CONTEXT] = self._context
            x[0, CONTEXT:] = self._buf[:WINDOW]
            if la:
                lx, lstate, lp, lnext = la.popleft()
                if (lstate is self._state or np.array_equal(lstate, self._state)) and np.array_equal(lx, x[0]):
                    self.precomputed += 1
                    self._accept(lp, lnext)
                    continue
                self._drop_plan()
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
