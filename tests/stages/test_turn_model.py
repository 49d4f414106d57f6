"""Smart Turn v3.2 (the ONNX file inside the pipecat-ai wheel): its input as the model was
trained, and the end-of-turn detector the session uses with it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("faster_whisper")


@pytest.fixture(scope="module")
def smart_turn():
    from tests.models import load_or_skip
    from tristream.stages.turn_model import SmartTurn

    return load_or_skip(SmartTurn)


def _voice(seconds: float, seed: int = 0) -> np.ndarray:
    """A voiced-like signal: a gliding harmonic tone with a syllable-rate envelope, then 300 ms of silence."""
    t = np.arange(int(seconds * 16_000)) / 16_000
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / 16_000
    x = sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2)
    x = x + np.random.default_rng(seed).normal(0, 0.01, t.shape[0])
    return np.concatenate([0.2 * x, np.zeros(4800)]).astype(np.float32)


def test_features_match_pipecats_reference_transform(smart_turn) -> None:
    """Our [1, 80, 800] input equals the transform Pipecat's own Smart Turn runs (short clips
    padded in front, long ones cut to their last 8 s, zero mean and unit variance)."""
    import importlib.util

    from tristream.stages.turn_model import smart_turn_path

    # the wheel's numpy transform, loaded as a file (the package itself imports loguru)
    spec = importlib.util.spec_from_file_location("_pipecat_whisper_features",
                                                  smart_turn_path().parents[1] / "_whisper_features.py")
    assert spec is not None and spec.loader is not None
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    for seconds in (2.0, 11.0):
        pcm = _voice(seconds)
        x = pcm[-128_000:]
        x = np.pad(x, (128_000 - x.shape[0], 0))
        theirs = ref.compute_whisper_log_mel_features(x, do_normalize=True)
        ours = smart_turn.features(pcm)
        assert ours.shape == (1, 80, 800)
        assert np.abs(ours[0] - theirs[:, :800]).max() < 1e-3


def test_the_detector_holds_an_unfinished_turn_and_ends_a_finished_one(smart_turn) -> None:
    from tristream.stages.turn_model import SmartTurnEndOfTurn

    pcm = _voice(3.0)
    p = smart_turn.probability(pcm)
    assert 0.0 <= p <= 1.0
    assert SmartTurnEndOfTurn(smart_turn, threshold=p + 1e-6, hold_ms=700).extra_wait_ms("", pcm) == 700
    assert SmartTurnEndOfTurn(smart_turn, threshold=p - 1e-6, hold_ms=700).extra_wait_ms("", pcm) == 0
    assert SmartTurnEndOfTurn(smart_turn).extra_wait_ms("some words") == 0  # no audio: the silence rule alone
