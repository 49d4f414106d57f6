"""Vision tokens in a GPU assistant session: the camera frames aligned to the user's speech, encoded by
the shared `FrameTokenizer` and prefilled into the session's LLM context while the user speaks.

- `VisionTokens` (one per process): the tokenizer, one encoder thread for every session, counters.
- `SessionVision` (one per session): watches the session's speech edges (`Session.subscribe`) and
  its frame ring (`Session.frames`, filed by capture time on the reference clock). While the user
  speaks, each incremental prefill (`ScheduledChat.prefill`) asks it for the frames captured since
  the start of speech, at most one per ``min_gap_ms`` of capture time; they are encoded in the
  encoder thread and their tokens join the next partial prompt. A budget of ``max_images`` frames
  per turn (``max_images * tokens_per_frame`` positions) bounds the context: the first frame stays
  and the newest replaces the one before it (counted ``images_over_budget``), so the prefix already
  prefilled survives. At the end of the turn the answer's prompt takes the frames picked while the
  user spoke (the context prefilled with them goes on); a turn without any (a typed message, or
  speech without frames) takes the latest frame at or before its end, encoded then. Frames still encoding after ``wait_ms`` are left out
  (``images_late``).
- `VisionPipelineBackend`: the pipeline backend whose session is bound to its `SessionVision`
  (its camera JPEGs are decoded off the event loop and its microphone appends coalesced:
  `PipelineBackend.decode_frames_off_loop`, `coalesce_audio`).

The encoder thread batches: the frames every session asked for while it was busy go through the
tower as one forward (at most ``max_batch``), so the per-call cost (kernel launches, the copy, the
synchronisation; ~20 ms of a 25 ms call for one frame when the event loop holds the GIL) is paid once
per batch rather than per frame.

The tokens enter the prompt as a user message of their own before the user's words
(`ScheduledEngine.encode_with_images`); the OpenCV scene text is not used on this path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from tristream.observe.events import SpeechStarted
from tristream.serve.metrics import Family
from tristream.serve.pipeline_backend import PipelineBackend

Span = tuple[Any, str]


@dataclass(slots=True)
class VisionPolicy:
    """Which frames of a turn become tokens."""

    max_images: int = 2
    min_gap_ms: float = 1000.0
    wait_ms: float = 150.0


class VisionTokens:
    """The process's frame tokenizer, its encoder thread and counters (see the module docstring)."""

    def __init__(self, tokenizer: Any, policy: VisionPolicy | None = None, max_batch: int = 32) -> None:
        self.tokenizer = tokenizer
        self.policy = policy or VisionPolicy()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vision-tokens")
        self.counters: dict[str, int] = {}
        self.max_batch = max_batch
        self._queue: list[tuple[np.ndarray, concurrent.futures.Future[Any]]] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, img: np.ndarray) -> concurrent.futures.Future[Any]:
        """The future (token tensor, cache key) of one frame, encoded in the next batch."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            self._queue.append((img, fut))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vision-tokens-batch", daemon=True)
                self._thread.start()
            self._cv.notify()
        return fut

    def _one_batch(self, imgs: list[np.ndarray]) -> list[Span]:
        # equal frames get equal cache keys: their positions are prefix-cache hits
        keys = [f"frame:{hashlib.blake2b(np.ascontiguousarray(im).data, digest_size=12).hexdigest()}" for im in imgs]
        toks = self.tokenizer.encode(imgs)
        return list(zip(toks, keys, strict=True))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            live = [(im, f) for im, f in batch if f.set_running_or_notify_cancel()]
            if not live:
                continue
            self.count("batches_multi" if len(live) > 1 else "batches_single")
            self.counters["batch_max"] = max(self.counters.get("batch_max", 0), len(live))
            try:
                out = self._one_batch([im for im, _ in live])
            except Exception as exc:  # every frame of the batch fails; the thread goes on
                for _, f in live:
                    f.set_exception(exc)
                continue
            for (_, f), span in zip(live, out, strict=True):
                f.set_result(span)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def warm_up(self) -> None:
        """First-call costs (kernel selection, allocator) before the first session."""
        self.tokenizer.encode([np.zeros((240, 320, 3), np.uint8)])

    def session(self) -> SessionVision:
        return SessionVision(self)

    def families(self) -> list[Family]:
        """Counters and the tokenizer's totals as Prometheus families."""
        st = self.tokenizer.stats
        vals = {**self.counters, "frames_encoded": st.frames, "encoder_batches": st.batches,
                "tokens_encoded": st.tokens, "patches_pruned": st.pruned}
        return [("tristream_vision_counter", "gauge", f"vision tokens ({self.tokenizer.weights} weights)",
                 [("tristream_vision_counter", {"name": k}, float(v)) for k, v in sorted(vals.items())]),
                ("tristream_vision_encode_seconds_total", "counter", "time in the vision tower",
                 [("tristream_vision_encode_seconds_total", {}, float(st.encode_s))])]


class SessionVision:
    """One session's frames → tokens (see the module docstring)."""

    def __init__(self, shared: VisionTokens) -> None:
        self.shared = shared
        self.session: Any = None
        self.speech_start_ns: int | None = None
        self.picks: list[tuple[int, concurrent.futures.Future[Any]]] = []
        """(capture time, future of the frame's tokens) of this turn, in time order."""

    def bind(self, session: Any) -> None:
        """Watch ``session``'s speech edges; read its frame ring."""
        self.session = session
        session.subscribe(self._on_event)

    def _on_event(self, ev: Any) -> None:
        if type(ev) is SpeechStarted and self.speech_start_ns is None:
            self.speech_start_ns = int(ev.ref_ns)
            self.picks = []

    def _encode(self, t_ns: int, img: np.ndarray) -> concurrent.futures.Future[Any]:
        return self.shared.submit(img)

    def refresh(self) -> None:
        """While the user speaks: start encoding the frames aligned to the speech so far."""
        s, start = self.session, self.speech_start_ns
        if s is None or start is None:
            return
        pol = self.shared.policy
        gap = max(1, int(pol.min_gap_ms * 1e6))
        last = self.picks[-1][0] if self.picks else None
        for t, img in s.frames.window(start if last is None else last + gap, s.clock.now_ns() + 1):
            if last is not None and t < last + gap:
                continue
            self.picks.append((t, self._encode(t, img)))
            self.shared.count("frames_aligned")
            last = t
        while len(self.picks) > pol.max_images:  # the first frame stays (it is prefilled), the newest comes in
            self.picks.pop(-2 if pol.max_images >= 2 else -1)
            self.shared.count("images_over_budget")

    def ready(self) -> list[Span]:
        """Tokens of this turn's frames that are encoded now."""
        return [f.result() for _, f in self.picks if f.done() and f.exception() is None]

    async def for_turn(self) -> list[Span]:
        """The answer's images: this turn's encoded frames (or the latest frame, encoded now);
        the turn's state is reset for the next one."""
        s = self.session
        if not self.picks:  # frames already picked stay as prefilled: the answer continues that context
            self.refresh()
        picks, self.picks, self.speech_start_ns = self.picks, [], None
        if not picks and s is not None:
            latest = s.frames.latest_at_or_before(s.clock.now_ns())
            if latest is not None:
                picks = [(latest[0], self._encode(*latest))]
                self.shared.count("frames_at_turn_end")
        if not picks:
            return []
        futs = [asyncio.wrap_future(f) for _, f in picks]
        done, pending = await asyncio.wait(futs, timeout=self.shared.policy.wait_ms / 1e3)
        out: list[Span] = []
        for f in futs:
            if f in done and f.exception() is None:
                out.append(f.result())
            elif f in done:
                self.shared.count("encode_errors")
            else:
                self.shared.count("images_late")
        self.shared.count("images_to_turns", len(out))
        self.shared.count("turns_with_images", 1 if out else 0)
        return out


class VisionPipelineBackend(PipelineBackend):
    """`PipelineBackend` whose session feeds a `SessionVision` (speech edges and frame ring)."""

    decode_frames_off_loop = True
    coalesce_audio = True

    def __init__(self, models: Any, vision: SessionVision, **kw: Any) -> None:
        super().__init__(models, **kw)
        self.vision = vision

    async def start(self, config: Any, sink: Any) -> None:
        await super().start(config, sink)
        self.vision.bind(self.session)


def build_vision_tokens(engine: Any, device: str, keep_ratio: float = 0.25,
                        policy: VisionPolicy | None = None) -> VisionTokens:
    """The shared vision tokens for ``engine``'s language model: SigLIP-B/16 and a projector into its
    hidden size, with random weights (no VLM weights are available offline), bf16 on CUDA."""
    import torch

    from tristream.vision.frames import FrameTokenizer, embedding_rms

    model = engine.model
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tok = FrameTokenizer.random(int(model.cfg.hidden_size), device, dtype, keep_ratio=keep_ratio,
                                match_rms=embedding_rms(model))
    vt = VisionTokens(tok, policy)
    vt.warm_up()
    return vt
