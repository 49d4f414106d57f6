from __future__ import annotations

import numpy as np
import pytest

from tests.models import load_or_skip
from tristream.observe.events import SpeechEvent, SpeechEventKind
from tristream.stages.asr import UtteranceStream, transcribe_offline
from tristream.stages.base import BadAudio

from .conftest import word_recall


@pytest.fixture(scope="module")
def whisper():
    from tristream.stages.asr_whisper import WhisperASR

    return load_or_skip(WhisperASR)


@pytest.fixture(scope="module")
def pocketsphinx():
    from tristream.stages.asr_pocketsphinx import PocketsphinxASR

    return load_or_skip(PocketsphinxASR)


def test_whisper_model_is_assembled_and_verified(whisper):
    from tristream.stages.asr_whisper import MODEL_BIN_SHA256, MODEL_BIN_SIZE, whisper_base_dir

    d = whisper_base_dir()
    assert (d / "model.bin").stat().st_size == MODEL_BIN_SIZE
    assert (d / ".verified").read_text().strip() == MODEL_BIN_SHA256
    assert {"config.json", "tokenizer.json", "vocabulary.txt"} <= {p.name for p in d.iterdir()}


def test_whisper_transcribes_known_sentences_with_partials(vad, track, whisper):
    out = transcribe_offline(track.pcm, vad.stream("w"), whisper.stream("w", partial_every_s=1.0))
    finals = [t for t in out if t.final]
    partials = [t for t in out if not t.final]
    assert len(finals) == len(track.segments)
    for seg, t in zip(track.segments, finals, strict=True):
        assert word_recall(seg.text, t.text) >= 0.75, (seg.text, t.text)
        # utterance times on the reference clock bracket the true speech
        assert t.start_ns <= seg.start * 62_500 + 50_000_000
        assert abs(t.end_ns - seg.end * 62_500) <= 50_000_000
        assert t.decided_ns >= t.end_ns
    assert partials, "partials while speaking"
    assert all(p.start_ns < p.end_ns for p in partials)


def test_whisper_full_window_agrees(track, whisper):
    from tristream.stages.asr_whisper import WhisperASR

    full = WhisperASR(window="full")
    seg = track.segments[0]
    clip = track.pcm[max(seg.start - 3200, 0): seg.end + 3200]
    assert word_recall(seg.text, full.transcribe(clip)) >= 0.75
    assert word_recall(seg.text, whisper.transcribe(clip)) >= 0.75


def test_whisper_refuses_over_30s(whisper):
    with pytest.raises(BadAudio, match="30 s"):
        whisper.transcribe(np.zeros(16000 * 31, dtype=np.float32))
    assert whisper.transcribe(np.zeros(0, dtype=np.float32)) == ""


def test_collapse_repeats():
    from tristream.stages.asr_whisper import collapse_repeats

    assert collapse_repeats("Turn it on. Turn it on. Turn it") == ("Turn it on.", 2)
    assert collapse_repeats("Hello there. How are you?") == ("Hello there. How are you?", 0)


def test_pocketsphinx_streams_finals(vad, track, pocketsphinx):
    out = transcribe_offline(track.pcm, vad.stream("p"), pocketsphinx.stream("p"))
    finals = [t for t in out if t.final]
    assert len(finals) == len(track.segments)
    recall = np.mean([word_recall(s.text, t.text) for s, t in zip(track.segments, finals, strict=True)])
    assert recall >= 0.4, [t.text for t in finals]
    # incremental decoding: the final costs only end_utt (no second passes)
    assert max(t.compute_s for t in finals) < 0.5


class _Echo:
    """A recogniser that reports how many samples it was fed (tests the stream's cutting)."""

    name = "echo"

    def utterance(self):
        class U:
            n = 0

            def feed(self, pcm):
                self.n += pcm.shape[0]

            def partial(self):
                return str(self.n)

            def final(self):
                return str(self.n)

        return U()


def test_utterance_stream_preroll_end_and_counters():
    s = UtteranceStream(_Echo(), "e", partial_every_s=None, preroll_s=0.1, postroll_s=0.1)
    pcm = np.zeros(16000, dtype=np.float32)
    s.push(pcm, 0)  # 1 s of audio before speech
    s.push(SpeechEvent("e", SpeechEventKind.START, 0, 0, 8000, 0.9))
    s.push(SpeechEvent("e", SpeechEventKind.END, 0, 0, 15000, 0.1))
    assert s.poll() == []  # waits for the postroll audio (up to 16600)
    s.push(np.zeros(1600, dtype=np.float32), 1_000_000_000)
    (t,) = s.poll()
    # from start-preroll (6400) to everything pushed (17600)
    assert t.final and int(t.text) == 17600 - 6400
    assert t.start_ns == 400_000_000
    s.push(SpeechEvent("e", SpeechEventKind.END, 0, 0, 20000, 0.1))
    assert s.counters["end_without_start"] == 1


def test_long_utterance_is_split_without_losing_audio():
    s = UtteranceStream(_Echo(), "l", partial_every_s=None, preroll_s=0.0, postroll_s=0.0, max_utterance_s=1.0)
    s.push(SpeechEvent("l", SpeechEventKind.START, 0, 0, 0, 0.9))
    for i in range(25):  # 2.5 s of speech in 100 ms chunks
        s.push(np.zeros(1600, dtype=np.float32), i * 100_000_000)
    s.push(SpeechEvent("l", SpeechEventKind.END, 0, 0, 40000, 0.1))
    finals = s.poll()
    assert [int(t.text) for t in finals] == [16000, 16000, 8000]
    assert s.counters["utterances_split_at_max_length"] == 2


def test_cancel_returns_pocketsphinx_decoder_to_pool(pocketsphinx):
    s = pocketsphinx.stream("c", partial_every_s=None)
    pool = len(pocketsphinx._pool)
    s.push(np.zeros(1600, dtype=np.float32), 0)
    s.push(SpeechEvent("c", SpeechEventKind.START, 0, 0, 0, 0.9))
    assert s.in_utterance and len(pocketsphinx._pool) == pool - 1
    s.cancel()
    assert not s.in_utterance and len(pocketsphinx._pool) == pool
    assert s.counters["utterances_cancelled"] == 1 and s.poll() == []
