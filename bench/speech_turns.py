"""Spoken turns of 2–25 s for the end-to-end CPU benchmark: piper and espeak-ng voices at several rates.

Each turn is a few everyday sentences read as one continuous turn (pauses between sentences
shorter than the VAD's hangover); its text is the reference for WER. Clips are 16 kHz mono float32, made once per
process and cached in `bench/data/turns/` (not tracked) so that runs compare like with like.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SENTENCES = (
    "Could you tell me what the weather will be like this afternoon.",
    "I am planning to go for a walk in the park with my dog.",
    "My sister is coming to visit next week and I need to clean the house.",
    "What is the best way to cook rice so that it does not stick to the pot.",
    "Yesterday I bought a new bicycle and rode it to work.",
    "Please remind me to call the doctor tomorrow morning at nine.",
    "I would like to know how many people live in the city of London.",
    "We watched a long movie last night and it was very good.",
    "Can you recommend a book about the history of the ocean.",
    "The train was late again so I missed the first part of the meeting.",
    "How far is it from the station to the museum if I walk.",
    "I think I left my keys in the kitchen next to the coffee machine.",
    "Our garden has tomatoes, beans and a small apple tree.",
    "Tell me a short story about a brave little mouse.",
    "What time does the grocery store close on Sunday evening.",
    "My phone battery is almost empty and I forgot the charger at home.",
)

_NORM = re.compile(r"[^a-z0-9' ]+")


@dataclass(slots=True)
class Turn:
    """One spoken turn: 16 kHz audio, its text, the voice that read it."""

    text: str
    pcm: np.ndarray
    voice: str

    @property
    def seconds(self) -> float:
        """Length of the clip."""
        return self.pcm.shape[0] / 16_000


def normalise(text: str) -> list[str]:
    """Lower-case words without punctuation (for WER)."""
    return _NORM.sub(" ", text.lower().replace("-", " ")).split()


def wer(ref: str, hyp: str) -> tuple[int, int]:
    """(word edits, reference words) between two texts (Levenshtein over normalised words)."""
    r, h = normalise(ref), normalise(hyp)
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            cur = min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
            prev, d[j] = d[j], cur
    return d[len(h)], len(r)


class _EspeakCli:
    """espeak-ng's command line at one rate (in-process espeak shares global state with piper's
    phonemiser, so two rates in one process need separate processes)."""

    sample_rate = 22_050

    def __init__(self, wpm: int) -> None:
        self.wpm = wpm

    def synthesize(self, text: str) -> np.ndarray:
        import subprocess
        import tempfile

        from tristream.stages.audio_io import read_wav

        with tempfile.NamedTemporaryFile(suffix=".wav") as f:
            subprocess.run(["espeak-ng", "-v", "en-us", "-s", str(self.wpm), "-w", f.name, text], check=True)
            pcm, self.sample_rate = read_wav(f.name)
        return pcm


def _voices() -> list[tuple[str, object]]:
    import shutil

    from tristream.stages.tts import PiperTTS

    out: list[tuple[str, object]] = [("piper", PiperTTS(deterministic=True)),
                                     ("piper-fast", PiperTTS(deterministic=True, length_scale=0.85))]
    if shutil.which("espeak-ng"):
        out += [("espeak-150", _EspeakCli(150)), ("espeak-190", _EspeakCli(190))]
    return out


def _speak(tts: object, text: str, pause_s: float, trim: bool = False) -> np.ndarray:
    """`text` sentence by sentence, `pause_s` of silence between sentences (`trim`: each
    sentence cut to its speech first, so the pause is all the silence there is)."""
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges

    parts = []
    for sentence in re.findall(r"[^.!?]+[.!?]", text):
        pcm = resample(tts.synthesize(sentence.strip()), tts.sample_rate, 16_000)  # type: ignore[attr-defined]
        if trim:
            a, b = energy_edges(pcm, 16_000)
            pcm = pcm[a:b]
        parts += [pcm, np.zeros(int(pause_s * 16_000), np.float32)]
    return np.concatenate(parts[:-1]).astype(np.float32)


def make_turns(sentence_counts: tuple[int, ...] = (1, 2, 3, 5, 7), per_count: int = 2, seed: int = 0,
               pause_s: float = 0.15, cache: Path | None = None) -> list[Turn]:
    """Turns of 1..7 sentences (≈ 2–25 s) for every voice, read as one continuous turn: each
    sentence trimmed to its speech, `pause_s` between sentences (below the VAD's 300 ms
    hangover, as in fluent speech); cached as .npy by content."""
    rng = np.random.default_rng(seed)
    cache = cache or Path(__file__).resolve().parent / "data" / "turns"
    cache.mkdir(parents=True, exist_ok=True)
    turns: list[Turn] = []
    voices = _voices()
    for k in sentence_counts:
        for _ in range(per_count):
            picks = rng.choice(len(SENTENCES), size=k, replace=False)
            text = " ".join(SENTENCES[i] for i in picks)
            for name, tts in voices:
                key = hashlib.sha1(f"{name}|{pause_s}|trim|{text}".encode()).hexdigest()[:16]
                f = cache / f"{key}.npy"
                if f.is_file():
                    pcm = np.load(f)
                else:
                    pcm = _speak(tts, text, pause_s, trim=True)
                    np.save(f, pcm)
                turns.append(Turn(text, pcm, name))
    return turns
