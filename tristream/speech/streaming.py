"""Many-stream streaming Whisper: per-stream audio buffers, one batched pass per update, LocalAgreement.

Audio arrives per stream in chunks (160–500 ms) stamped with the reference-clock time of their
first sample; each chunk is uploaded once (pinned, async) into the stream's device-resident row
of an `AudioStore`. `step()` takes every stream with at least `min_update_s` of new audio, runs
them in one `WhisperRunner` pass (one encoder call for all), turns tokens into words timed by the
alignment heads' cross-attention (DTW, edges snapped onto pauses) on the reference clock, and
feeds each stream's `LocalAgreement`. With a runner built with `max_draft > 0`, each stream's
previous hypothesis (tokens and their frames) is its draft: the pass verifies it in parallel
and decodes only the tail, and only the tail is re-timed. A buffer longer than `trim_after_s` is
cut at the end of its last committed word (or, with nothing committed, to its newest `keep_s` —
counted in `stats.forced_trims`); a trim drops the draft (`stats.draft_resets`).

Word times only where needed (`align="commit"`): the pass runs without the
alignment-heads pass; each stream's hypothesis first gets provisional times (tokens timed by an
earlier aligned pass keep their frames; the others are spread evenly from the later of the last
timed frame and the committed end to the end of the audio) and LocalAgreement is asked, without
changing it, whether the update would commit a word. Only streams that would, streams with
committed audio in the buffer but no timed token (after a trim: which re-heard words are already
committed is decided by time) and closing streams are aligned, together, on the smallest batch
bucket that holds them; their exact words
are then inserted. Committed words therefore always carry DTW times; partial words of an update
without alignment carry the provisional ones. `align="every"` (the default) times every stream
every update. "commit" saves work only with drafts (`max_draft > 0`): without one, no token keeps
its times from an earlier pass, so every update with committed audio in the buffer is aligned.
The price of "commit": a stream whose newest update was not aligned needs one more
pass at `close()` (its flushed partial needs times), right after the end of speech; `step(final=...)`
folds that into a batched update when the caller knows which streams are ending.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from tristream.speech.audio_store import AudioStore
from tristream.speech.commit import LocalAgreement, Word
from tristream.speech.config import FRAME_S, SAMPLE_RATE
from tristream.speech.errors import AudioInputError
from tristream.speech.runner import WhisperRunner
from tristream.speech.timing import voiced_bytes
from tristream.speech.words import WordCache
from tristream.speech.words import tokens_to_words as tokens_to_words  # re-exported: its former home

NS = 1_000_000_000
_FRAME_SAMPLES = round(FRAME_S * SAMPLE_RATE)  # 320 samples per encoder frame


@dataclass(slots=True)
class TranscriptEvent:
    """One stream's change after an update: newly final words and the current partial."""

    stream_id: str
    committed: list[Word]
    partial: list[Word]
    final: bool = False

    @property
    def text(self) -> str:
        return "".join(w.text for w in self.committed)


@dataclass(slots=True)
class StreamingStats:
    """Counters with reasons; nothing is dropped without one."""

    updates: int = 0
    passes: int = 0
    trims: int = 0
    forced_trims: int = 0
    discontinuities: int = 0
    clipped_samples: int = 0
    draft_resets: int = 0
    aligned: int = 0  # stream updates timed by the alignment pass
    unaligned: int = 0  # stream updates with provisional times only (align="commit")


@dataclass(slots=True)
class _Stream:
    slot: int
    t0_ns: int
    agreement: LocalAgreement
    length: int = 0
    new_samples: int = 0
    draft: list[int] = field(default_factory=list)
    draft_frames: list[int] = field(default_factory=list)
    timed: int = 0  # leading entries of draft_frames set by an aligned pass (the rest provisional)
    exact: bool = True  # the newest hypothesis inserted carried aligned times
    plain: WordCache = field(default_factory=WordCache)  # words of the last hypothesis with provisional times
    snapped: WordCache = field(default_factory=WordCache)  # ... and with aligned times, snapped onto pauses

    def end_ns(self) -> int:
        return self.t0_ns + self.length * NS // SAMPLE_RATE


class StreamingWhisper:
    """Streaming ASR over many streams sharing one batched, graphed Whisper pass per update."""

    def __init__(self, runner: WhisperRunner, text_of: Callable[[int], str], *, agreement_n: int = 2,
                 min_update_s: float = 0.16, trim_after_s: float | None = None, keep_s: float = 2.0,
                 max_streams: int = 256, align: str = "every") -> None:
        if align not in ("commit", "every"):
            raise ValueError(f"align must be 'commit' or 'every', not {align!r}")
        self.align = align
        self.runner = runner
        self.text_of = functools.lru_cache(maxsize=1 << 16)(text_of)  # one decode per token id, not per use
        self.agreement_n = agreement_n
        self.min_update = int(min_update_s * SAMPLE_RATE)
        self.max_samples = int(runner.audio_buckets[-1] * SAMPLE_RATE)
        self.trim_after = int((trim_after_s if trim_after_s is not None else runner.audio_buckets[-1] * 0.8)
                              * SAMPLE_RATE)
        self.keep = int(keep_s * SAMPLE_RATE)
        self.streams: dict[str, _Stream] = {}
        self.store = AudioStore(max_streams, self.max_samples, runner.device)
        self.stats = StreamingStats()

    def open(self, stream_id: str, t0_ns: int) -> None:
        """Start a stream whose first sample is at reference time `t0_ns`."""
        if stream_id in self.streams:
            raise AudioInputError(f"stream {stream_id!r} is already open")
        self.streams[stream_id] = _Stream(self.store.acquire(), t0_ns, LocalAgreement(self.agreement_n))

    def push(self, stream_id: str, samples: np.ndarray, t_ns: int | None = None) -> None:
        """Append mono float32 16 kHz samples; `t_ns` (first sample's reference time) checks continuity."""
        s = self._get(stream_id)
        if samples.ndim != 1 or samples.dtype != np.float32:
            raise AudioInputError(f"audio chunk must be 1-D float32 at 16 kHz; got {samples.dtype} {samples.shape}")
        n = samples.shape[0]
        if n > self.max_samples:
            raise AudioInputError(f"chunk of {n} samples is longer than the largest audio bucket; send 160-500 ms chunks")
        if t_ns is not None and abs(t_ns - s.end_ns()) > NS // 100:
            self.stats.discontinuities += 1
            if not s.length:
                s.t0_ns = t_ns
        if s.length + n > self.max_samples:
            cut = s.length + n - self.max_samples
            self.stats.clipped_samples += cut
            self._trim(s, cut, forced=True)
        self.store.append(s.slot, samples)
        s.length += n
        s.new_samples += n

    def ready(self) -> list[str]:
        """Streams with enough new audio for an update."""
        return [k for k, s in self.streams.items() if s.new_samples >= self.min_update]

    def step(self, stream_ids: list[str] | None = None, final: Collection[str] = ()) -> list[TranscriptEvent]:
        """Run one update over the ready streams (batched in passes of the largest bucket).

        Streams in `final` are about to be closed: they get word times in this update whatever the
        commit policy, so that `close()` needs no pass of its own (see `needs_final_pass`)."""
        ids = self.ready() if stream_ids is None else stream_ids
        events: list[TranscriptEvent] = []
        cap = self.runner.batch_buckets[-1]
        for i in range(0, len(ids), cap):
            events.extend(self._pass(ids[i : i + cap], final))
        return events

    def needs_final_pass(self, stream_id: str) -> bool:
        """Whether `close()` would run a pass: unseen audio, or a newest hypothesis without word times."""
        s = self._get(stream_id)
        return bool(s.new_samples) or not s.exact

    def close(self, stream_id: str) -> TranscriptEvent:
        """Final update for a stream, then flush its partial as final and forget it."""
        s = self._get(stream_id)
        committed: list[Word] = []
        if s.new_samples or not s.exact:  # the last pass may commit words; the flushed partial needs times
            committed += self._pass([stream_id], {stream_id})[0].committed
        committed += s.agreement.flush().committed
        self.store.release(s.slot)
        del self.streams[stream_id]
        return TranscriptEvent(stream_id, committed, [], final=True)

    def discard(self, stream_id: str) -> None:
        """Forget a stream without a final pass (its audio and hypotheses are dropped)."""
        s = self._get(stream_id)
        self.store.release(s.slot)
        del self.streams[stream_id]

    # ---- internals ---------------------------------------------------------------------------
    def _get(self, stream_id: str) -> _Stream:
        try:
            return self.streams[stream_id]
        except KeyError:
            raise AudioInputError(f"stream {stream_id!r} is not open; call open() first") from None

    def _trim(self, s: _Stream, n: int, forced: bool) -> None:
        n = max(0, min(n, s.length))
        self.store.trim(s.slot, n)
        s.length -= n
        s.t0_ns += n * NS // SAMPLE_RATE
        s.agreement.forget_before(s.t0_ns)
        s.plain.reset()
        s.snapped.reset()
        if s.draft:  # the draft's first tokens were for the audio just cut; decode afresh
            s.draft, s.draft_frames, s.timed = [], [], 0
            self.stats.draft_resets += 1
        self.stats.trims += 1
        self.stats.forced_trims += int(forced)

    def _pass(self, ids: list[str], force: Collection[str] = ()) -> list[TranscriptEvent]:
        try:
            streams = [self.streams[i] for i in ids]
        except KeyError:
            streams = [self._get(i) for i in ids]  # raises, naming the stream
        runner = self.runner
        lazy = self.align == "commit" and runner.word_times
        drafts = [s.draft for s in streams] if runner.max_draft else None
        frames = ([s.draft_frames[: s.timed] for s in streams] if lazy else [s.draft_frames for s in streams]) \
            if runner.max_draft else None
        res = runner.run_store(self.store, [s.slot for s in streams], drafts, frames, word_times=not lazy)
        self.stats.passes += 1
        eot = runner.tokens.eot
        text_of = self.text_of
        n = len(streams)
        valid = [-(-s.length // _FRAME_SAMPLES) for s in streams]  # ceil: frames holding audio
        toks: list[list[int]] = res.tokens[:n].tolist()
        fr: list[list[int]] = res.frames[:n].tolist()
        voiced: list[bytes | None] = [None] * n if res.voiced is None else _mask_rows(res.voiced[:n], valid)
        n_text = [t.index(eot) if eot in t else len(t) for t in toks]  # text tokens before end-of-text
        exact = [not lazy] * n
        fresh: list[list[Word]] = []  # per stream, LocalAgreement.fresh of its provisional words
        if lazy:
            unsure: list[bool] = []
            accepted = res.accepted[:n].tolist()
            for k, s in enumerate(streams):
                keep = min(s.timed, accepted[k])  # frames of accepted draft tokens still hold
                fr[k] = self._provisional(s, n_text[k], s.draft_frames[:keep], valid[k])
                s.timed = keep
                fresh.append(s.agreement.fresh(s.plain.words_for(toks[k], fr[k], text_of, eot, s.t0_ns, valid[k])))
                # which re-heard words `fresh` drops as already committed is decided by time: with
                # committed audio still in the buffer and nothing timed (after a trim), align
                unsure.append(keep == 0 and s.agreement.committed_end_ns > s.t0_ns)
            need = [k for k, s in enumerate(streams)
                    if ids[k] in force or unsure[k] or s.agreement.pending_fresh(fresh[k]) > 0]
            if need:
                ex, vo = runner.align_rows(need, [s.draft_frames[: s.timed] for s in (streams[k] for k in need)]
                                           if runner.max_draft else None)
                masks = _mask_rows(vo, [valid[k] for k in need])
                for i, k in enumerate(need):
                    fr[k], voiced[k], exact[k] = ex[i].tolist(), masks[i], True
        out: list[TranscriptEvent] = []
        for k, s in enumerate(streams):
            tk, fk = toks[k], fr[k]
            if exact[k]:
                new = s.agreement.fresh(s.snapped.words_for(tk, fk, text_of, eot, s.t0_ns, valid[k], voiced[k]))
            else:
                new = fresh[k]
            s.draft = tk[: n_text[k]]
            s.draft_frames = fk[: n_text[k] + 1]
            if exact[k]:
                s.timed = len(s.draft_frames)
            s.exact = exact[k]
            committed, partial = s.agreement.insert_fresh(new)
            s.new_samples = 0
            out.append(TranscriptEvent(ids[k], committed, partial))
            if s.length > self.trim_after:
                if s.agreement.committed and s.agreement.committed_end_ns > s.t0_ns:
                    cut = (s.agreement.committed_end_ns - s.t0_ns) * SAMPLE_RATE // NS
                    self._trim(s, int(cut), forced=False)
                else:
                    self._trim(s, s.length - self.keep, forced=True)
        aligned = exact.count(True)
        self.stats.aligned += aligned
        self.stats.unaligned += n - aligned
        self.stats.updates += n
        return out

    def _provisional(self, s: _Stream, n_text: int, timed: list[int], valid: int) -> list[int]:
        """Frames for a hypothesis of `n_text` text tokens before alignment: `timed` (frames of its
        accepted draft prefix from an earlier aligned pass), then the remaining tokens and the end
        row spread evenly from the later of the last timed frame and the committed end to the end of
        the audio."""
        rest = n_text + 1 - len(timed)
        if rest <= 0:
            return timed[: n_text + 1]
        lo = timed[-1] if timed else 0
        committed = s.agreement.committed
        if committed:  # (nothing committed: the committed end is far before the buffer)
            ce = (committed[-1].end_ns - s.t0_ns) * SAMPLE_RATE // NS // _FRAME_SAMPLES
            lo = ce if ce > lo else lo
        hi = valid - 1 if valid > 1 else 0
        lo = 0 if lo < 0 else hi if lo > hi else lo
        if rest == 1:
            return [*timed, lo]
        step = (hi - lo) / (rest - 1)
        return timed + [int(lo + i * step) for i in range(rest - 1)] + [hi]


def _mask_rows(voiced: np.ndarray, valid: list[int]) -> list[bytes | None]:
    """Row i of a pass's voiced masks `[rows, T]`, cut to its `valid[i]` frames, as `voiced_bytes`
    (what `WordCache.words_for` reads): one conversion for all rows, then byte slices."""
    t = voiced.shape[1]
    flat = voiced_bytes(voiced)
    return [flat[i * t : i * t + (f if f < t else t)] for i, f in enumerate(valid)]


def hf_token_text(tokenizer_json: str) -> Callable[[int], str]:
    """Token id → text using an HF `tokenizer.json` (byte-level BPE, spaces kept). Uncached:
    `StreamingWhisper` caches whatever `text_of` it is given."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)

    def text_of(tid: int) -> str:
        return tok.decode([tid], skip_special_tokens=True)

    return text_of
