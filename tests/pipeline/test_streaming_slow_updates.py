"""The CPU streaming recogniser when updates come seldom (a loaded machine: another session's
decodes queued, so each update covers up to 4 s of new audio): the buffer is trimmed only
behind words that are committed, so no speech is dropped however few words an update commits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

SEVEN = ("The train was late again so I missed the first part of the meeting. How far is it from the "
         "station to the museum if I walk. What is the best way to cook rice so that it does not stick "
         "to the pot. Could you tell me what the weather will be like this afternoon. Please remind me "
         "to call the doctor tomorrow morning at nine. Our garden has tomatoes, beans and a small apple "
         "tree. I would like to know how many people live in the city of London.")


@pytest.mark.parametrize("voice", ["say", "espeak-190"])
def test_updates_every_four_seconds_keep_every_word(models, say, voice: str) -> None:
    from speech_turns import _EspeakCli, _speak, wer

    from tristream.stages.asr_stream import AgreementWhisper

    if voice == "say":
        pcm = say(SEVEN)
    else:  # the bench's fast espeak-ng voice: its first updates disagree early ("late" / "8")
        import shutil

        if shutil.which("espeak-ng") is None:
            pytest.skip("espeak-ng is not installed")
        pcm = _speak(_EspeakCli(190), SEVEN, pause_s=0.15, trim=True)  # as the bench makes its turns
    assert pcm.shape[0] > 15 * 16_000
    recognizer = AgreementWhisper(models.asr.asr, step_s=4.0, inline=True)
    u = recognizer.utterance()
    for i in range(0, pcm.shape[0], 320):
        u.feed(pcm[i:i + 320])
    final = u.final()
    edits, words = wer(SEVEN, final)
    assert recognizer.stats.trims >= 1  # the buffer was cut while the user spoke
    assert edits / words <= 0.1, final
    assert "london" in final.lower()
