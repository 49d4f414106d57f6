"""Streaming Whisper on CPU (LocalAgreement): committed words while the user speaks, only the tail at the end.

`AgreementWhisper` turns the CTranslate2 Whisper of `asr_whisper` into a streaming recogniser
with LocalAgreement-2 (Macháček et al., "Turning Whisper into Real-Time Transcription System"):

- Every `step_s` of new speech the utterance's *buffer* (the audio not yet trimmed away) is
  encoded with a window sized to the audio present (`WhisperASR.encode`: no padded 30 s), and
  decoded with the words already committed in this buffer forced as a decoder prefix, so only
  the uncommitted part is generated. The words that two consecutive hypotheses agree on are
  committed; committed text only grows, and each growth is a partial transcript.
- When the buffer is longer than `trim_s`, Whisper's cross-attention alignment
  (`WhisperASR.word_times`) places the committed words in time and the audio is cut at a gap
  between two committed words at least `keep_s` before its end; the words before the cut
  become settled text, the last `context_tokens` of it go to the decoder as previous text.
  The encoder therefore never sees more than about `trim_s + step_s` of audio, whatever the
  length of the turn.
- At the end of the utterance (`final()`) one decode of the buffer with the committed prefix
  forced gives the uncommitted tail: settled + committed + tail is the transcript. The session
  can start that final decode at the onset of silence (`speculate()`); if the user stays
  silent, `final()` takes its text.

All decodes of all sessions run on one worker thread of the recogniser (CTranslate2 uses
`threads` cores per call), finals and speculations before updates; an update that finds its
utterance already finished is skipped, and while other decodes wait, a session's next update
waits for proportionally more audio (up to 4 × `step_s`). Decoding loops (Whisper
repeating a phrase on a short window) are cut (`drop_loops`) before agreement.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tristream.stages.asr import UtteranceStream
from tristream.stages.asr_whisper import SAMPLE_RATE, DecodeRequest, DecodeResult, WhisperASR

__all__ = ["AgreementWhisper", "StreamingUtterance", "local_agreement"]

_NORM = re.compile(r"[^\w']+")


def _key(word: str) -> str:
    """A word compared without case and punctuation; punctuation alone compares as itself."""
    return _NORM.sub("", word.lower()) or word.strip()


def local_agreement(a: list[str], b: list[str]) -> int:
    """Length of the longest common prefix of two word lists (case and punctuation ignored)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if _key(x) != _key(y):
            break
        n += 1
    return n


def _cut_loops(words: list[tuple[str, list[int]]], before: Sequence[str] = ()) -> list[tuple[str, list[int]]]:
    """Words up to Whisper's first decoding loop: a run of ≥ 2 words repeated right after itself,
    one word three times in a row, or a sentence that starts like an earlier one of the buffer
    (`before`: the committed words ahead of `words`) — Whisper re-reading its window."""
    keys = [_key(w) for w, _ in words]
    n = len(keys)
    for i in range(n):
        if i + 2 < n and keys[i] == keys[i + 1] == keys[i + 2] and keys[i].isalnum():
            return words[:i + 1]
        for p in range(2, (n - i) // 2 + 1):
            if keys[i:i + p] == keys[i + p:i + 2 * p]:
                return words[:i + p]
    every = [_key(w) for w in before] + keys
    starts = [0] + [j + 1 for j, k in enumerate(every) if k in (".", "?", "!")]
    seen: set[tuple[str, ...]] = set()
    for j in starts:
        head = tuple(every[j:j + 3])
        if len(head) < 2:
            continue
        if head in seen and j >= len(before):
            return words[:j - len(before)]
        if len(head) == 3:
            seen.add(head)
            seen.add(head[:2])
    return words


class _Decode:
    """A decode job: `prepare` (on the decode thread, when its batch forms) gives the request,
    or None when there is nothing to decode; `finish` turns its result (None when skipped)
    into the job's value. `key` keeps two jobs of one utterance out of one batch."""

    __slots__ = ("finish", "key", "prepare")

    def __init__(self, key: int, prepare: Callable[[], DecodeRequest | None],
                 finish: Callable[[DecodeResult | None], Any]) -> None:
        self.key, self.prepare, self.finish = key, prepare, finish


_Job = tuple[int, int, _Decode, "concurrent.futures.Future[Any]"]


class _Worker:
    """One thread that runs decode jobs by priority (0 before 1), in order within a priority;
    the jobs of the same priority waiting when one starts (up to `max_batch`, one per
    utterance) run with it as one batched decode (`WhisperASR.decode_batch`)."""

    def __init__(self, name: str, decode: Callable[[list[DecodeRequest]], list[DecodeResult]],
                 max_batch: int) -> None:
        self._heap: list[_Job] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._decode = decode
        self.max_batch = max_batch
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.jobs = 0
        self.batches = 0

    def submit(self, priority: int, job: _Decode) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            heapq.heappush(self._heap, (priority, next(self._seq), job, fut))
            self._cv.notify()
        return fut

    def _take(self) -> list[_Job]:
        with self._cv:
            while not self._heap:
                self._cv.wait()
            batch: list[_Job] = []
            later: list[_Job] = []
            keys: set[int] = set()
            while self._heap and len(batch) < self.max_batch:
                item = heapq.heappop(self._heap)
                if item[3].cancelled():
                    continue
                if batch and item[0] != batch[0][0]:  # finals batch with finals only: none waits on updates
                    later.append(item)
                    break
                (later if item[2].key in keys else batch).append(item)
                keys.add(item[2].key)
            for item in later:
                heapq.heappush(self._heap, item)
            return batch

    def _run(self) -> None:
        while True:
            run_batch(self._take(), self._decode)
            self.batches += 1


def run_batch(batch: list[_Job], decode: Callable[[list[DecodeRequest]], list[DecodeResult]]) -> None:
    """Prepare each job, decode the requests together, finish each (errors go to the job's
    future; a failed batch fails each of its jobs)."""
    live: list[tuple[_Decode, concurrent.futures.Future[Any], DecodeRequest]] = []
    for _, _, job, fut in batch:
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            req = job.prepare()
            if req is None:
                fut.set_result(job.finish(None))
            else:
                live.append((job, fut, req))
        except BaseException as exc:  # delivered to whoever waits on the job
            fut.set_exception(exc)
    for group in by_length(live, key=lambda item: item[2].pcm.shape[0]):
        _decode_live(group, decode)


LENGTH_RATIO = 1.5
"""Buffers batch together only when the longest is at most this many times the shortest
(plus one second): a short buffer padded with many seconds of silence is heard worse (a 4-clip
batch heard "museum if I walk" as "Museum of Firewall"), and the padding costs encoder time."""


def by_length(items: list[Any], key: Callable[[Any], int], ratio: float = LENGTH_RATIO,
              slack: int = SAMPLE_RATE) -> list[list[Any]]:
    """`items` in groups of similar length (sorted by `key`; a group's longest is at most
    `ratio` × its shortest + `slack`)."""
    groups: list[list[Any]] = []
    for item in sorted(items, key=key):
        if groups and key(item) <= key(groups[-1][0]) * ratio + slack:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def _decode_live(live: list[tuple[_Decode, concurrent.futures.Future[Any], DecodeRequest]],
                 decode: Callable[[list[DecodeRequest]], list[DecodeResult]]) -> None:
    try:
        results = decode([req for _, _, req in live])
    except Exception as exc:
        if len(live) == 1:
            live[0][1].set_exception(exc)
            return
        for item in live:  # a batch that fails is decoded item by item: one bad request fails alone
            _decode_live([item], decode)
        return
    for (job, fut, _), res in zip(live, results, strict=True):
        try:
            fut.set_result(job.finish(res))
        except Exception as exc:
            fut.set_exception(exc)


@dataclass(slots=True)
class StreamStats:
    """Counters of a `AgreementWhisper` over all its utterances."""

    updates: int = 0
    updates_skipped: int = 0
    trims: int = 0
    words_committed: int = 0
    finals: int = 0
    speculation_hits: int = 0
    speculation_misses: int = 0
    loops_cut: int = 0
    decodes: int = 0
    batches: int = 0
    tail_redecodes: int = 0
    decode_s: float = 0.0  # time in batched decodes (updates, finals, speculations)
    redecode_s: float = 0.0  # time in the finals' afresh decodes (part of the finals' wait)


class AgreementWhisper:
    """A streaming recogniser over one loaded `WhisperASR` (shared by every session)."""

    name = "whisper-stream"
    streaming = True

    def __init__(self, asr: WhisperASR | None = None, step_s: float = 1.0, trim_s: float = 6.0,
                 keep_s: float = 1.5, context_tokens: int = 64, min_window_s: float = 2.0,
                 inline: bool = False, max_batch: int = 4) -> None:
        """``inline``: run every decode on the caller's thread as soon as it is due (offline
        evaluation and deterministic tests: the result no longer depends on timing);
        ``max_batch``: the most decodes (of different utterances) in one batched call."""
        self.asr = asr or WhisperASR()
        self.inline = inline
        self.step = int(step_s * SAMPLE_RATE)
        self.trim = int(trim_s * SAMPLE_RATE)
        self.keep = int(keep_s * SAMPLE_RATE)
        self.context_tokens = context_tokens
        self.min_window_s = min_window_s
        self.stats = StreamStats()
        self._worker = None if inline else _Worker("asr-stream", self._decode_batch, max_batch)

    def _decode_batch(self, reqs: list[DecodeRequest]) -> list[DecodeResult]:
        self.stats.decodes += len(reqs)
        self.stats.batches += 1
        t0 = time.perf_counter()
        try:
            return self.asr.decode_batch(reqs)
        finally:
            self.stats.decode_s += time.perf_counter() - t0

    def transcribe(self, pcm: np.ndarray) -> str:
        """Whole-clip text (no streaming), as `WhisperASR.transcribe`."""
        return self.asr.transcribe(pcm)

    def utterance(self) -> StreamingUtterance:
        """A streaming decoder for one utterance."""
        return StreamingUtterance(self)

    def stream(self, session_id: str, partial_every_s: float | None = None) -> UtteranceStream:
        """A per-session ASR stream; partials are the committed words (checked every 100 ms)."""
        return UtteranceStream(self, session_id, partial_every_s=0.1, max_utterance_s=600.0)

    def queued(self) -> int:
        """Decodes waiting for the decode thread (0 inline)."""
        return 0 if self._worker is None else len(self._worker._heap)

    def submit(self, priority: int, job: _Decode) -> concurrent.futures.Future[Any]:
        """Run a decode job on the decode thread (0: finals and speculations, 1: updates);
        inline: now, alone."""
        if self._worker is not None:
            return self._worker.submit(priority, job)
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        run_batch([(priority, 0, job, fut)], self._decode_batch)
        return fut


@dataclass(slots=True)
class _Hyp:
    words: list[tuple[str, list[int]]] = field(default_factory=list)


class StreamingUtterance:
    """One utterance of a `AgreementWhisper`: feed audio, read committed text, finish with the tail.

    State changes only on the recogniser's decode thread (updates, trims) or under `_lock`
    (feeding); `partial()` and `committed_text` never wait for a decode.
    """

    def __init__(self, owner: AgreementWhisper) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._audio: list[np.ndarray] = []
        self._n = 0  # samples fed
        self._buf_start = 0  # sample index (in this utterance) where the buffer begins
        self._buf = np.zeros(0, dtype=np.float32)  # audio from _buf_start, joined lazily
        self.settled: list[str] = []  # words trimmed out of the buffer
        self._context: list[int] = []  # their last tokens, the decoder's previous text
        self.committed: list[tuple[str, list[int]]] = []  # agreed words inside the buffer
        self._prev: list[tuple[str, list[int]]] = []  # the last hypothesis beyond `committed`
        self._last_update_at = 0
        self._committed_at = 0  # samples fed when the committed words last grew
        self._pending: concurrent.futures.Future[Any] | None = None
        self._spec: concurrent.futures.Future[tuple[int, str]] | None = None
        self._done = False

    # ---- feeding (caller's thread) ------------------------------------------------------
    def feed(self, pcm: np.ndarray) -> None:
        """Add audio; an update is queued every `step_s` of new audio (none while one waits)."""
        with self._lock:
            self._audio.append(np.asarray(pcm, dtype=np.float32))
            self._n += int(pcm.shape[0])
            # under load (other sessions' decodes queued) updates come less often: finals first
            step = self.owner.step * (1 + min(self.owner.queued(), 3))
            due = self._n - self._last_update_at >= step and self._pending is None and not self._done
            if due:
                self._last_update_at = self._n
                self._pending = _PLACEHOLDER
        if due:
            fut = self.owner.submit(1, _Decode(id(self), self._update_request, self._update_done))
            with self._lock:
                if self._pending is _PLACEHOLDER:
                    self._pending = fut

    def partial(self) -> str:
        """Settled + committed words (only ever grows within the utterance)."""
        return self.committed_text

    @property
    def committed_text(self) -> str:
        """The text no later decode of this utterance will change."""
        with self._lock:
            return _join(self.settled + [w for w, _ in self.committed])

    # ---- decode thread ------------------------------------------------------------------
    def _take_buffer(self) -> tuple[np.ndarray, int]:
        with self._lock:
            if self._audio:
                joined = np.concatenate([self._buf, *self._audio])
                self._audio = []
                self._buf = joined
            return self._buf, self._n

    @property
    def stalled(self) -> bool:
        """No word committed for `STALL_S` of audio though some are: Whisper, forced a prefix
        that ends a sentence, can end there for every update; decodes then go without it."""
        return bool(self.committed) and self._n - self._committed_at > STALL_S * SAMPLE_RATE

    def _request(self, buf: np.ndarray) -> DecodeRequest:
        """Decode `buf` with the committed words forced (none when stalled) and the settled
        text as context."""
        prefix = [] if self.stalled else [t for _, toks in self.committed for t in toks]
        dur = buf.shape[0] / SAMPLE_RATE
        return DecodeRequest(buf, prefix, self._context[-self.owner.context_tokens:],
                             int(dur * 7) + 16 - len(prefix), self.owner.min_window_s)

    def _words(self, res: DecodeResult) -> list[tuple[str, list[int]]]:
        """The hypothesis beyond the committed prefix, up to Whisper's first loop."""
        words = self.owner.asr.split_words(res.tokens)
        kept = _cut_loops(words, [w for w, _ in self.committed] if res.request.prefix else [])
        if len(kept) < len(words):
            self.owner.stats.loops_cut += 1
        return kept

    def _update_request(self) -> DecodeRequest | None:
        with self._lock:
            self._pending = None
            if self._done:
                self.owner.stats.updates_skipped += 1
                return None
        buf, _ = self._take_buffer()
        return self._request(buf)

    def _update_done(self, res: DecodeResult | None) -> None:
        if res is None:
            return
        words = self._words(res)
        if not res.request.prefix and self.committed:  # a stalled buffer decoded afresh
            k = len(self.committed)
            if local_agreement([w for w, _ in words], [w for w, _ in self.committed]) < k // 2:
                return  # it does not read the committed words back: no safe place to continue
            words = words[k:]
        self._agree(words)
        buf_len = res.request.pcm.shape[0]
        if buf_len > self.owner.trim and len(self.committed) >= 2:
            self._trim(res, buf_len)

    def _agree(self, hyp: list[tuple[str, list[int]]]) -> None:
        """Commit the words `hyp` (beyond the committed prefix) shares with the last hypothesis."""
        self.owner.stats.updates += 1
        n = local_agreement([w for w, _ in hyp], [w for w, _ in self._prev])
        with self._lock:
            if self._done:
                return
            self.committed.extend(hyp[:n])
            self._prev = hyp[n:]
            self.owner.stats.words_committed += n
            if n:
                self._committed_at = self._n

    def _trim(self, res: DecodeResult, buf_len: int) -> None:
        """Cut the buffer at a gap between committed words at least `keep_s` before its end.

        The times come from aligning the whole hypothesis (committed words and the rest): the
        committed words alone, aligned to the whole buffer, stretch over audio that holds
        uncommitted speech, and a cut there would drop it (3 committed words of an 8 s buffer
        placed the cut at 6.4 s: 40 words of a 91-word turn lost)."""
        asr = self.owner.asr
        words = self.committed + self._prev
        tokens = [t for _, toks in words for t in toks]
        times = asr.word_times(res.enc, tokens, res.frames, row=res.row)
        if len(times) != len(words):
            return
        times = times[:len(self.committed)]
        limit = (buf_len - self.owner.keep) / SAMPLE_RATE
        cut_word, cut_s = -1, 0.0
        for i in range(len(times) - 1):
            end_i, start_next = times[i][1], times[i + 1][0]
            if start_next <= limit:
                cut_word, cut_s = i, (end_i + start_next) / 2
        if cut_word < 0:
            return
        cut = int(cut_s * SAMPLE_RATE)
        with self._lock:
            if self._done:
                return
            moved = self.committed[:cut_word + 1]
            self.committed = self.committed[cut_word + 1:]
            self.settled.extend(w for w, _ in moved)
            self._context.extend(t for _, toks in moved for t in toks)
            self._context = self._context[-self.owner.context_tokens:]
            self._buf = self._buf[cut:]
            self._buf_start += cut
            self.owner.stats.trims += 1

    def _final_job(self) -> _Decode:
        """The tail decode; its value is (samples covered, transcript) (`_FinalDecode`)."""
        job = _FinalDecode(self)
        return _Decode(id(self), job.prepare, job.finish)

    # ---- end of the utterance -----------------------------------------------------------
    def speculate(self, pool: Any = None) -> None:
        """Start the final decode on the audio so far (the onset of silence)."""
        if self._spec is None:
            self._spec = self.owner.submit(0, self._final_job())

    @property
    def speculating(self) -> bool:
        """Whether a speculative final runs or ran and was not dropped."""
        return self._spec is not None

    def drop(self) -> None:
        """The user spoke again: the speculation no longer covers the utterance."""
        if self._spec is not None:
            self._spec.cancel()
            self._spec = None

    def final(self, max_extra_s: float = 1.0) -> str:
        """The transcript: the speculative one when only silence came after it, else a decode
        of the buffer's uncommitted tail (waits for the decode thread)."""
        st = self.owner.stats
        spec = self._spec
        if spec is not None and not spec.cancelled():
            n, text = spec.result()
            if self._n - n <= int(max_extra_s * SAMPLE_RATE):
                st.speculation_hits += 1
                self._finish()
                return text
            st.speculation_misses += 1
        _, text = self.owner.submit(0, self._final_job()).result()
        self._finish()
        return text

    def abort(self) -> None:
        """Drop the utterance without a final."""
        self.drop()
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            self._done = True
            self.owner.stats.finals += 1
            if self._pending is not None and self._pending is not _PLACEHOLDER:
                self._pending.cancel()
            self._pending = None


class _FinalDecode:
    """One final (or speculative final) decode of a `StreamingUtterance`: the words ahead of the
    tail are those committed when the batch formed (`prepare`), and `finish` decides among three
    cases which text the decode gives.

    A speculative final's words are not committed when the user speaks on: commits then end at
    sentence ends, and Whisper, forced a prefix that ends a sentence, tends to end there for
    every later update too (a 20 s turn lost its last 12 s that way)."""

    __slots__ = ("heard", "n", "quiet", "settled", "u", "words")

    def __init__(self, u: StreamingUtterance) -> None:
        self.u = u
        self.n = 0  # samples covered
        self.settled: list[str] = []
        self.words: list[str] = []  # settled + committed
        self.heard = 0  # words of the last hypothesis beyond the committed ones
        self.quiet = 0  # samples since the last commit

    def prepare(self) -> DecodeRequest | None:
        u = self.u
        buf, self.n = u._take_buffer()
        with u._lock:
            self.settled = list(u.settled)
            self.words = u.settled + [w for w, _ in u.committed]
            self.heard = len(u._prev)
            self.quiet = u._n - u._committed_at
        return u._request(buf) if buf.shape[0] else None

    def finish(self, res: DecodeResult | None) -> tuple[int, str]:
        u = self.u
        tail = u._words(res) if res is not None else []
        if res is not None and not res.request.prefix and len(self.words) > len(self.settled):
            # stalled: the buffer was decoded afresh; it replaces the committed words
            return self.n, _join(self.settled + [w for w, _ in tail])
        short = (self.heard >= 3 and len(tail) < self.heard // 2) or (not tail and self.quiet > SAMPLE_RATE)
        if res is not None and short:
            again = self._afresh(res.request)
            if len(again) > len(self.words) - len(self.settled) + len(tail):
                return self.n, _join(self.settled + again)
        return self.n, _join(self.words + [w for w, _ in tail])

    def _afresh(self, req: DecodeRequest) -> list[str]:
        """Whisper ended soon after the forced words although the last update heard more beyond
        them, or nothing followed them after a second of audio: the buffer decoded without the
        forced prefix (`tail_redecodes`)."""
        owner = self.u.owner
        owner.stats.tail_redecodes += 1
        t0 = time.perf_counter()
        again = owner.asr.decode_batch([DecodeRequest(
            req.pcm, [], req.context, int(req.pcm.shape[0] / SAMPLE_RATE * 7) + 16, req.min_window_s)])[0]
        owner.stats.redecode_s += time.perf_counter() - t0
        return [w for w, _ in _cut_loops(owner.asr.split_words(again.tokens))]


STALL_S = 3.0
"""Audio without a new committed word after which decodes drop the forced prefix."""

_PLACEHOLDER: concurrent.futures.Future[Any] = concurrent.futures.Future()
"""Marks an update as queued between the decision and its `submit` (outside the lock)."""


def _join(words: list[str]) -> str:
    return "".join(words).strip()
