from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from tristream.stages.audio_io import write_wav
from tristream.stages.base import resample

from .conftest import word_recall


@pytest.fixture(scope="module")
def app():
    from tristream.cli import app

    return app


def test_transcribe_resamples_and_prints_times(app, track, tmp_path):
    wav = tmp_path / "talk.wav"
    seg = track.segments[0]
    clip = track.pcm[: seg.end + 16000]
    write_wav(wav, resample(clip, 16000, 22050), 22050)
    res = CliRunner().invoke(app, ["transcribe", str(wav), "--engine", "pocketsphinx"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith("[00:00.")
    assert word_recall(seg.text, lines[0].split("] ", 1)[1]) >= 0.4
    assert "resampled 22050 Hz" in res.stderr


def test_transcribe_clear_errors(app, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["transcribe", str(tmp_path / "missing.wav")])
    assert res.exit_code == 2 and "no such file" in res.stderr
    bad = tmp_path / "bad.wav"
    bad.write_text("not audio")
    res = runner.invoke(app, ["transcribe", str(bad)])
    assert res.exit_code == 2 and "not a PCM WAV" in res.stderr
    low = tmp_path / "low.wav"
    write_wav(low, resample(np.zeros(8000, dtype=np.float32), 16000, 4000), 4000)
    res = runner.invoke(app, ["transcribe", str(low)])
    assert res.exit_code == 2 and "below 8000 Hz" in res.stderr
