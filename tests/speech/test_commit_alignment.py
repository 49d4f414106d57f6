"""Word times only where needed: alignment of selected rows after the pass, LocalAgreement's dry
run, and streaming with commit-only alignment vs aligning every update (tiny random Whisper, CPU)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tristream.speech.commit import LocalAgreement, Word
from tristream.speech.config import WhisperTokens
from tristream.speech.errors import AudioInputError
from tristream.speech.runner import WhisperRunner
from tristream.speech.streaming import NS, StreamingWhisper
from tristream.speech.whisper import Whisper

TOKENS = WhisperTokens.for_vocab(51865)
MS = 1_000_000


def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    env = (np.sin(2 * np.pi * 1.3 * t + seed) > -0.3).astype(np.float32)  # speech-like bursts and pauses
    return (env * 0.3 * np.sin(2 * np.pi * (180 + 40 * seed) * t) + 0.02 * rng.standard_normal(t.size)).astype(
        np.float32)


def _runner(model: Whisper, **kw: object) -> WhisperRunner:
    args: dict[str, object] = dict(batch_buckets=(1, 2, 4), audio_buckets_s=(2.0, 5.0), max_new_tokens=10, chunk=4,
                                   early_stop=False, max_draft=8)
    args.update(kw)
    return WhisperRunner(model, TOKENS, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("rows", [[3, 1], [0, 1], [2], [2, 0, 3]])  # moved to a smaller bucket / in place
def test_align_rows_equals_the_fully_timed_pass(tiny_whisper: Whisper, rows: list[int]) -> None:
    r = _runner(tiny_whisper)
    audio = [_audio(1.2 + 0.7 * i, i) for i in range(4)]
    first = r.run(audio)
    drafts = [row[:6].tolist() for row in first.tokens]
    dfr = [row[:7].tolist() for row in first.frames]
    full = r.run(audio, drafts, dfr)
    lazy = r.run(audio, drafts, dfr, word_times=False)
    assert lazy.voiced is None and not lazy.frames.any()
    np.testing.assert_array_equal(lazy.tokens, full.tokens)
    frames, voiced = r.align_rows(rows, [dfr[i] for i in rows])
    np.testing.assert_array_equal(frames, full.frames[rows])
    assert full.voiced is not None
    np.testing.assert_array_equal(voiced, full.voiced[rows])
    assert r.stats.deferred_rows == 4 and r.stats.aligned_rows == 4 + 4 + len(rows)
    with pytest.raises(AudioInputError, match="distinct rows"):
        r.align_rows([1, 1])


WORDS = ["a", "b", "c", "d", "e", "f"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), max_size=8), min_size=1, max_size=10), st.integers(2, 3),
       st.lists(st.integers(0, 400), min_size=10, max_size=10))
def test_pending_is_what_insert_commits(hyps: list[list[int]], n: int, shifts: list[int]) -> None:
    la = LocalAgreement(n)
    for step, (h, sh) in enumerate(zip(hyps, shifts, strict=False)):
        base = step * 200 * MS - sh * MS  # later hypotheses may start before the committed end
        words = [Word(WORDS[x], base + i * 300 * MS, base + (i + 1) * 300 * MS) for i, x in enumerate(h)]
        before = copy.deepcopy(la)
        k = la.pending(words)
        assert la.committed == before.committed and la._history == before._history  # a dry run
        assert len(la.insert(words).committed) == k


class ScriptedRunner:
    """A stand-in for `WhisperRunner` that hears a scripted transcript like a streaming model does:
    every word fully inside the buffer, at its true time (20 ms frames from the buffer start); the
    newest word flickers between two spellings as the buffer grows, and the last two tokens' frames
    wobble by a frame. Word times come only from `align_rows` or timed passes."""

    def __init__(self, words: dict[str, list[tuple[int, int]]], max_draft: int = 16) -> None:
        from tristream.speech.pass_io import RunnerStats

        self.words = words  # stream id -> (start_ns, end_ns) per word; token id 1000 + index
        self.tokens = TOKENS
        self.max_draft = max_draft
        self.word_times = True
        self.batch_buckets = (1, 2, 4)
        self.audio_buckets = (6.0,)
        self.device = "cpu"
        self.k = 24
        self.stats = RunnerStats()
        self.asr: StreamingWhisper | None = None
        self.calls = 0
        self.last: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def _hear(self, slot: int) -> tuple[list[int], list[int], int]:
        assert self.asr is not None
        sid, s = next((k, v) for k, v in self.asr.streams.items() if v.slot == slot)
        t0, end = s.t0_ns, s.t0_ns + s.length * NS // 16000
        heard = [(i, a, b) for i, (a, b) in enumerate(self.words[sid]) if b <= end and b > t0 + 40 * MS]
        toks = [1000 + i for i, _, _ in heard]
        frames = [max(0, (a - t0) // (20 * MS)) for _, a, _ in heard]
        flick = (s.length // 8000) % 2  # a function of the audio heard: the same buffer, the same hypothesis
        if toks and flick:
            toks[-1] += 500  # the newest word flickers
        for j in range(max(0, len(frames) - 2), len(frames)):
            frames[j] += flick  # and its time wobbles
        tail = max(0, (heard[-1][2] - t0) // (20 * MS)) if heard else 0
        return toks[: self.k], frames[: self.k] + [tail], -(-s.length // 320)

    def run_store(self, store: object, slots: list[int], drafts: object = None, draft_frames: object = None,
                  word_times: bool | None = None):  # type: ignore[no-untyped-def]
        from tristream.speech.pass_io import PassResult

        self.calls += 1
        n = len(slots)
        toks = np.full((n, self.k), TOKENS.eot, np.int64)
        frames = np.zeros((n, self.k + 1), np.int64)
        acc = np.zeros(n, np.int64)
        for r, slot in enumerate(slots):
            t, f, valid = self._hear(slot)
            toks[r, : len(t)] = t
            frames[r, : len(f)] = f
            frames[r, len(f):] = f[-1]
            d = list(drafts[r]) if drafts is not None else []  # type: ignore[index]
            while acc[r] < min(len(d), len(t), self.max_draft) and d[acc[r]] == t[acc[r]]:
                acc[r] += 1
        self.last = (toks, frames, acc)
        timed = word_times is not False
        voiced = np.ones((n, 300), bool) if timed else None
        self.stats.aligned_rows += n if timed else 0
        self.stats.deferred_rows += 0 if timed else n
        return PassResult(toks, frames if timed else np.zeros_like(frames), 6.0, n, acc, 0, voiced)

    def align_rows(self, rows: list[int], draft_frames: object = None) -> tuple[np.ndarray, np.ndarray]:
        assert self.last is not None
        self.stats.aligned_rows += len(rows)
        return self.last[1][rows], np.ones((len(rows), 300), bool)


def _script(seed: int, seconds: float) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    out, t = [], int(rng.integers(50, 300)) * MS
    while t < seconds * NS:
        d = int(rng.integers(180, 420)) * MS
        out.append((t, t + d))
        t += d + int(rng.integers(20, 400)) * MS
    return out


def _scripted_stream(align: str, seconds: float = 12.0) -> tuple[dict[str, list[Word]], StreamingWhisper]:
    starts = {f"s{i}": (3 + i) * NS for i in range(3)}
    script = {sid: [(t0 + a, t0 + b) for a, b in _script(i, seconds)] for i, (sid, t0) in enumerate(starts.items())}
    r = ScriptedRunner(script)
    asr = StreamingWhisper(r, lambda t: f" w{t}", min_update_s=0.5, trim_after_s=4.0, keep_s=1.0,  # type: ignore[arg-type]
                           align=align)
    r.asr = asr
    for sid, t0 in starts.items():
        asr.open(sid, t0)
    got: dict[str, list[Word]] = {sid: [] for sid in starts}
    chunk = 8000
    silence = np.zeros(chunk, np.float32)
    for k in range(0, int(seconds * 16000), chunk):
        for sid in starts:
            asr.push(sid, silence, starts[sid] + k * NS // 16000)
        for e in asr.step():
            got[e.stream_id] += e.committed
    for sid in starts:
        got[sid] += asr.close(sid).committed
    return got, asr


def test_scripted_commit_only_alignment_commits_what_aligning_every_update_does() -> None:
    lazy, a = _scripted_stream("commit")
    every, b = _scripted_stream("every")
    assert a.stats.unaligned > 0.3 * a.stats.updates and b.stats.unaligned == 0
    assert a.stats.trims >= 3  # commits across buffer trims
    for sid, words in every.items():
        assert len(words) >= 20
        assert [w.text for w in lazy[sid]] == [w.text for w in words]
        assert all(x.start_ns == y.start_ns and x.end_ns == y.end_ns for x, y in zip(lazy[sid], words, strict=True))
        assert all(x.start_ns <= y.start_ns for x, y in zip(words, words[1:]))  # noqa: B905
    print(f"scripted: {a.stats.unaligned}/{a.stats.updates} stream updates without the alignment pass; "
          f"aligned rows {a.runner.stats.aligned_rows} vs {b.runner.stats.aligned_rows}")


def _stream(model: Whisper, align: str, seconds: float = 4.0) -> StreamingWhisper:
    r = _runner(model, max_new_tokens=12, max_draft=10)
    asr = StreamingWhisper(r, lambda t: f" w{t % 3}", min_update_s=0.32, trim_after_s=3.0, keep_s=1.0, align=align)
    starts = {f"s{i}": (1 + i) * NS for i in range(3)}
    for sid, t0 in starts.items():
        asr.open(sid, t0)
    audio = {sid: _audio(seconds, 11 + i) for i, sid in enumerate(starts)}
    chunk = 5120
    for k in range(0, int(seconds * 16000), chunk):
        for sid, a in audio.items():
            asr.push(sid, a[k : k + chunk], starts[sid] + k * NS // 16000)
        asr.step()
    for sid in starts:
        asr.close(sid)
    return asr


def test_random_model_streams_align_only_committing_updates(tiny_whisper: Whisper) -> None:
    """Random weights hear no speech (their DTW times are arbitrary, so the two policies may commit
    differently); what must hold: fewer aligned rows, and every pass inserted with provisional
    times commits nothing (committed words always carry alignment times)."""
    a = _stream(tiny_whisper, "commit")
    assert a.stats.unaligned > 0 and a.stats.aligned > 0
    assert a.runner.stats.aligned_rows + a.runner.stats.deferred_rows > a.runner.stats.aligned_rows
    assert a.runner.stats.aligned_rows < a.stats.updates


def test_align_policy_is_checked(tiny_whisper: Whisper) -> None:
    with pytest.raises(ValueError, match="'commit' or 'every'"):
        StreamingWhisper(_runner(tiny_whisper), lambda t: "x", align="sometimes")


@pytest.mark.gpu
def test_graphed_align_rows_equals_the_timed_pass(make_whisper) -> None:  # type: ignore[no-untyped-def]
    """CUDA graphs: rows moved to the front and aligned on a smaller bucket give the frames of the
    fully timed pass (float32, so both buckets' kernels agree on the DTW path)."""
    import torch

    model = make_whisper().to("cuda", torch.float32)
    r = WhisperRunner(model, TOKENS, batch_buckets=(1, 2, 4), audio_buckets_s=(2.0, 5.0), max_new_tokens=10, chunk=4,
                      early_stop=False, max_draft=8, use_graphs=True)
    r.capture()
    audio = [_audio(1.2 + 0.7 * i, i) for i in range(4)]
    first = r.run(audio)
    drafts = [row[:6].tolist() for row in first.tokens]
    dfr = [row[:7].tolist() for row in first.frames]
    full = r.run(audio, drafts, dfr)
    for rows in ([3, 1], [0], [2, 0, 1]):
        lazy = r.run(audio, drafts, dfr, word_times=False)
        np.testing.assert_array_equal(lazy.tokens, full.tokens)
        frames, voiced = r.align_rows(rows, [dfr[i] for i in rows])
        assert (np.abs(frames - full.frames[rows]) <= 1).all()
        assert full.voiced is not None
        np.testing.assert_array_equal(voiced, full.voiced[rows])
