"""Word times of real Whisper base (the shipped CTranslate2 weights, loaded into our module) on
TTS speech whose word boundaries are known:

- isolated words: each word synthesised alone (piper), joined with 150–400 ms pauses, so every
  word's true start and end are its energy edges;
- continuous speech: two sentences synthesised whole, word edges from piper's own phoneme
  durations (its duration predictor's per-phoneme sample counts; needs the `onnx` package).

CPU, eager. Skips when the model wheels, the TTS or `onnx` are not installed.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.models import load_or_skip
from tristream.speech.config import WhisperTokens
from tristream.speech.runner import WhisperRunner
from tristream.speech.streaming import NS, StreamingWhisper, hf_token_text, tokens_to_words

SR = 16_000
WORDS = "the quick brown fox jumps over the lazy dog".split()
TOL_S = 0.10  # word edge vs truth, after snapping onto pauses
CONTINUOUS = "The quick brown fox jumps over the lazy dog. A cold wind blew across the quiet harbor this morning."


@pytest.fixture(scope="module")
def base():  # type: ignore[no-untyped-def]
    from tristream.speech.ct2 import load_ct2_whisper
    from tristream.stages.asr_whisper import whisper_base_dir
    folder = load_or_skip(whisper_base_dir)
    return folder, load_ct2_whisper(folder)


@pytest.fixture(scope="module")
def track() -> tuple[np.ndarray, list[tuple[str, float, float]]]:
    from tests.speech.truth import isolated_words

    return load_or_skip(lambda: isolated_words(WORDS))


def _key(text: str) -> str:
    return re.sub(r"[^a-z']", "", text.lower())


def _errors(words: list, truth: list[tuple[str, float, float]], t0_ns: int = 0) -> np.ndarray:
    """|start − true start|, |end − true end| per word (s), words matched in order."""
    assert len(words) == len(truth), [w.text for w in words]
    same = sum(_key(w.text) == t for w, (t, _, _) in zip(words, truth, strict=True))
    assert same >= len(truth) - 2, [w.text for w in words]  # base hears the isolated "the" as "that"
    return np.array([[abs((w.start_ns - t0_ns) / NS - a), abs((w.end_ns - t0_ns) / NS - b)]
                     for w, (_, a, b) in zip(words, truth, strict=True)])


def test_dtw_word_times_equal_faster_whisper_and_snap_to_true_edges(base, track) -> None:  # type: ignore[no-untyped-def]
    folder, model = base
    pcm, truth = track
    text_of = hf_token_text(str(folder / "tokenizer.json"))
    toks = WhisperTokens.for_vocab(model.dims.vocab_size)
    r = WhisperRunner(model, toks, batch_buckets=(1,), audio_buckets_s=(6.0,), max_new_tokens=24, chunk=8)
    res = r.run([pcm])
    valid = -(-pcm.size // 320)
    raw = tokens_to_words(res.tokens[0].tolist(), res.frames[0].tolist(), text_of, toks.eot, 0, valid)
    assert res.voiced is not None
    snapped = tokens_to_words(res.tokens[0].tolist(), res.frames[0].tolist(), text_of, toks.eot, 0, valid,
                              res.voiced[0])
    err_raw, err = _errors(raw, truth), _errors(snapped, truth)
    assert err.max() <= TOL_S, err
    assert err_raw.max() > 2 * err.max()  # DTW alone counts each pause into the next word
    faster_whisper = pytest.importorskip("faster_whisper")
    fw = faster_whisper.WhisperModel(str(folder), device="cpu", compute_type="float32", cpu_threads=2)
    segs, _ = fw.transcribe(pcm, language="en", beam_size=1, temperature=0, word_timestamps=True,
                            condition_on_previous_text=False, vad_filter=False)
    ref = [w for s in segs for w in (s.words or [])]
    assert len(ref) == len(raw)
    # same algorithm (alignment heads, normalisation, median filter, DTW) as whisper/faster-whisper;
    # they encode a 30 s window, we a 6 s bucket. The last word's end differs: faster-whisper clips
    # it with its own heuristics, we take the end-of-text row's jump (then snap it to the pause)
    diffs = [max(abs(w.start_ns / NS - f.start), abs(w.end_ns / NS - f.end))
             for w, f in zip(raw[:-1], ref[:-1], strict=True)]
    assert max(diffs) <= 0.08, diffs
    assert abs(raw[-1].start_ns / NS - ref[-1].start) <= 0.08


def _stream(model, folder, pcm: np.ndarray, max_draft: int, t0: int, align: str = "commit"):  # type: ignore[no-untyped-def]
    toks = WhisperTokens.for_vocab(model.dims.vocab_size)
    r = WhisperRunner(model, toks, batch_buckets=(1,), audio_buckets_s=(3.0, 6.0), max_new_tokens=24, chunk=2,
                      max_draft=max_draft)
    asr = StreamingWhisper(r, hf_token_text(str(folder / "tokenizer.json")), min_update_s=0.5, trim_after_s=5.9,
                           align=align)
    asr.open("s", t0)
    committed = []
    chunk = SR // 2
    for k in range(0, pcm.size, chunk):
        asr.push("s", pcm[k : k + chunk], t0 + k * NS // SR)
        for e in asr.step():
            committed += e.committed
    committed += asr.close("s").committed
    return committed, r.stats, asr.stats


def test_streaming_with_drafts_commits_the_words_at_their_true_times(base, track) -> None:  # type: ignore[no-untyped-def]
    """0.5 s updates; LocalAgreement-2 commits; the previous hypothesis is the draft. Word times only
    for committing updates (the default) vs the plain way (no draft, every update aligned): the same
    words, at the same times within two frames."""
    folder, model = base
    pcm, truth = track
    t0 = 7 * NS
    committed, st, sst = _stream(model, folder, pcm, 23, t0)
    err = _errors(committed, truth, t0)
    assert err.max() <= TOL_S, err
    plain_words, plain, pst = _stream(model, folder, pcm, 0, t0, align="every")
    assert [w.text for w in plain_words] == [w.text for w in committed]  # drafts and lazy word times change no word
    dt = [max(abs(a.start_ns - b.start_ns), abs(a.end_ns - b.end_ns)) / NS for a, b in zip(committed, plain_words,
                                                                                            strict=True)]
    print(f"commit-only alignment: {sst.unaligned}/{sst.updates} updates without the alignment pass; "
          f"max |time difference| vs aligning every update {max(dt) * 1e3:.0f} ms")
    assert max(dt) <= 0.04, dt
    assert sst.unaligned > 0 and pst.unaligned == 0
    print(f"serial decoder steps: {st.decode_steps} with drafts ({st.draft_accepted}/{st.draft_tokens} draft tokens "
          f"accepted) vs {plain.decode_steps} without, over {sum(st.passes.values())} updates; "
          f"max word-edge error {err.max() * 1e3:.0f} ms")
    assert st.draft_accepted > 0.3 * st.draft_tokens
    assert st.decode_steps < 0.7 * plain.decode_steps


@pytest.fixture(scope="module")
def continuous() -> tuple[np.ndarray, list[tuple[str, float, float]]]:
    """Two sentences, no inserted pauses; truth = first..last phoneme of each word (piper alignments)."""
    from tests.speech.truth import continuous_speech

    return load_or_skip(lambda: continuous_speech(CONTINUOUS))


def test_word_times_on_continuous_speech(base, continuous) -> None:  # type: ignore[no-untyped-def]
    folder, model = base
    pcm, truth = continuous
    toks = WhisperTokens.for_vocab(model.dims.vocab_size)
    text_of = hf_token_text(str(folder / "tokenizer.json"))
    res = WhisperRunner(model, toks, batch_buckets=(1,), audio_buckets_s=(10.0,), max_new_tokens=40, chunk=8).run([pcm])
    valid = -(-pcm.size // 320)
    assert res.voiced is not None
    got = {}
    for snap in (False, True):
        words = tokens_to_words(res.tokens[0].tolist(), res.frames[0].tolist(), text_of, toks.eot, 0, valid,
                                res.voiced[0] if snap else None)
        assert len(words) == len(truth) == 19, [w.text for w in words]
        got[snap] = np.array([[abs(w.start_ns / NS - a), abs(w.end_ns / NS - b)]
                              for w, (_, a, b) in zip(words, truth, strict=True)])
    med, worst = np.median(got[True], axis=0), got[True].max(axis=0)
    print(f"continuous speech, 19 words: DTW median |err| start {np.median(got[False][:, 0]) * 1e3:.0f} ms, end "
          f"{np.median(got[False][:, 1]) * 1e3:.0f} ms; snapped: {med[0] * 1e3:.0f} / {med[1] * 1e3:.0f} ms, "
          f"max {worst[0] * 1e3:.0f} / {worst[1] * 1e3:.0f} ms")
    assert med.max() <= 0.10 and worst.max() <= 0.30
    assert np.median(got[False]) <= 0.20
