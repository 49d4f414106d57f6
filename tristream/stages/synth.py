"""Synthetic conversations for tests, benchmarks and the demo: TTS speech mixed with silence.

The true speech edges of each clip are measured from its energy (10 ms frames, first/last
frame within `floor_db` of the clip's loudest frame), not assumed from the clip length: TTS
output carries leading/trailing near-silence that a VAD must not count as speech.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tristream.stages.base import resample

__all__ = ["Segment", "SpeechTrack", "energy_edges", "make_track"]

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please turn on the kitchen lights before dinner.",
    "What is the weather going to be like tomorrow morning?",
    "My favourite colour is green and I like to read books.",
    "Call my sister and tell her I will be late.",
    "There are seven apples and three oranges on the table.",
)


@dataclass(slots=True, frozen=True)
class Segment:
    """One spoken sentence in a track: sample edges at the track's rate and its text."""

    start: int
    end: int
    text: str


@dataclass(slots=True, frozen=True)
class SpeechTrack:
    """Mono float32 audio with the known speech segments in it."""

    pcm: np.ndarray
    sample_rate: int
    segments: tuple[Segment, ...]

    @property
    def duration_s(self) -> float:
        """Length in seconds."""
        return self.pcm.shape[0] / self.sample_rate


def energy_edges(pcm: np.ndarray, sample_rate: int, floor_db: float = 40.0, frame_ms: float = 10.0) -> tuple[int, int]:
    """(first, last) sample of the speech in a clip: frames within `floor_db` of the peak frame."""
    n = max(int(sample_rate * frame_ms / 1000), 1)
    frames = pcm[: pcm.shape[0] // n * n].reshape(-1, n)
    rms = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1) + 1e-20)
    db = 20 * np.log10(rms / rms.max())
    active = np.flatnonzero(db > -floor_db)
    if active.size == 0:
        raise ValueError("clip has no energy above the floor")
    return int(active[0] * n), int((active[-1] + 1) * n)


def make_track(synthesize, clip_rate: int, texts: tuple[str, ...] = SENTENCES[:3],
               gaps_s: tuple[float, ...] = (0.8, 1.2, 1.0, 0.9), sample_rate: int = 16_000,
               noise_db: float = -60.0, seed: int = 0) -> SpeechTrack:
    """Speak `texts` with `synthesize(text) -> pcm@clip_rate`, separated by `gaps_s` of silence.

    Each clip is trimmed to its energy edges so that segment edges are exact; a little white
    noise at `noise_db` keeps the silence realistic.
    """
    rng = np.random.default_rng(seed)
    noise_std = float(10 ** (noise_db / 20))
    parts: list[np.ndarray] = []
    segments: list[Segment] = []
    pos = 0
    for i, text in enumerate(texts):
        gap = np.zeros(int(gaps_s[i % len(gaps_s)] * sample_rate), dtype=np.float32)
        parts.append(gap)
        pos += gap.shape[0]
        clip = resample(np.asarray(synthesize(text), dtype=np.float32), clip_rate, sample_rate)
        a, b = energy_edges(clip, sample_rate)
        clip = clip[a:b]
        parts.append(clip)
        segments.append(Segment(pos, pos + clip.shape[0], text))
        pos += clip.shape[0]
    parts.append(np.zeros(int(gaps_s[len(texts) % len(gaps_s)] * sample_rate), dtype=np.float32))
    pcm = np.concatenate(parts)
    pcm = pcm + np.asarray(rng.normal(0.0, noise_std, size=pcm.shape[0]), dtype=np.float32)
    return SpeechTrack(np.clip(pcm, -1, 1).astype(np.float32), sample_rate, tuple(segments))
