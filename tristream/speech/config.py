"""Whisper shapes (tiny … large-v3) and special tokens, read from an HF `config.json` or a preset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tristream.speech.errors import WhisperWeightsError

SAMPLE_RATE = 16_000
HOP = 160
N_FFT = 400
FRAME_S = 2 * HOP / SAMPLE_RATE  # one encoder position = two mel frames = 20 ms


@dataclass(frozen=True, slots=True)
class WhisperDims:
    """Sizes of a Whisper model."""

    d_model: int
    encoder_layers: int
    decoder_layers: int
    heads: int
    ffn: int
    n_mels: int = 80
    vocab_size: int = 51865
    max_source_positions: int = 1500
    max_target_positions: int = 448

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> WhisperDims:
        """Build from an HF `WhisperConfig` dict."""
        try:
            heads = int(d["encoder_attention_heads"])
            if int(d.get("decoder_attention_heads", heads)) != heads:
                raise WhisperWeightsError("encoder and decoder head counts differ; not a standard Whisper")
            return cls(
                d_model=int(d["d_model"]),
                encoder_layers=int(d["encoder_layers"]),
                decoder_layers=int(d["decoder_layers"]),
                heads=heads,
                ffn=int(d.get("encoder_ffn_dim", 4 * int(d["d_model"]))),
                n_mels=int(d.get("num_mel_bins", 80)),
                vocab_size=int(d.get("vocab_size", 51865)),
                max_source_positions=int(d.get("max_source_positions", 1500)),
                max_target_positions=int(d.get("max_target_positions", 448)),
            )
        except KeyError as e:
            raise WhisperWeightsError(f"Whisper config lacks {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """An HF `WhisperConfig` dict with these sizes (for building reference models)."""
        return dict(
            d_model=self.d_model, encoder_layers=self.encoder_layers, decoder_layers=self.decoder_layers,
            encoder_attention_heads=self.heads, decoder_attention_heads=self.heads, encoder_ffn_dim=self.ffn,
            decoder_ffn_dim=self.ffn, num_mel_bins=self.n_mels, vocab_size=self.vocab_size,
            max_source_positions=self.max_source_positions, max_target_positions=self.max_target_positions,
        )


PRESETS: dict[str, WhisperDims] = {
    "tiny": WhisperDims(384, 4, 4, 6, 1536),
    "base": WhisperDims(512, 6, 6, 8, 2048),
    "small": WhisperDims(768, 12, 12, 12, 3072),
    "medium": WhisperDims(1024, 24, 24, 16, 4096),
    "large-v2": WhisperDims(1280, 32, 32, 20, 5120),
    "large-v3": WhisperDims(1280, 32, 32, 20, 5120, n_mels=128, vocab_size=51866),
}


def preset(name: str) -> WhisperDims:
    """Dims of a named Whisper size."""
    try:
        return PRESETS[name]
    except KeyError:
        raise WhisperWeightsError(f"unknown Whisper size {name!r}; choose one of {sorted(PRESETS)}") from None


@dataclass(frozen=True, slots=True)
class WhisperTokens:
    """Special token ids, derived from the vocabulary size as OpenAI's tokenizer lays them out."""

    eot: int
    sot: int
    language: int | None
    transcribe: int
    no_timestamps: int

    @classmethod
    def for_vocab(cls, vocab_size: int, language_index: int = 0) -> WhisperTokens:
        """Multilingual (51865/51866) or English-only (51864) layout; `language_index` 0 is English."""
        if vocab_size >= 51865:
            n_langs = vocab_size - 51765 - 1
            eot, sot = 50257, 50258
            translate = sot + 1 + n_langs
            return cls(eot, sot, sot + 1 + language_index, translate + 1, translate + 5)
        if vocab_size == 51864:
            return cls(50256, 50257, None, 50358, 50362)
        raise WhisperWeightsError(f"vocab size {vocab_size} is not a Whisper vocabulary (51864/51865/51866)")

    def prompt(self) -> tuple[int, ...]:
        """`<|startoftranscript|><|lang|><|transcribe|><|notimestamps|>`."""
        lang = () if self.language is None else (self.language,)
        return (self.sot, *lang, self.transcribe, self.no_timestamps)


# OpenAI's alignment heads (decoder layer, head) whose cross-attention tracks the spoken word,
# as published with the multilingual checkpoints (whisper/__init__.py `_ALIGNMENT_HEADS`).
ALIGNMENT_HEADS: dict[str, tuple[tuple[int, int], ...]] = {
    "tiny": ((2, 2), (3, 0), (3, 2), (3, 3), (3, 4), (3, 5)),
    "base": ((3, 1), (4, 2), (4, 3), (4, 7), (5, 1), (5, 2), (5, 4), (5, 6)),
    "small": ((5, 3), (5, 9), (8, 0), (8, 4), (8, 7), (8, 8), (9, 0), (9, 7), (9, 9), (10, 5)),
    "medium": ((13, 15), (15, 4), (15, 15), (16, 1), (20, 0), (23, 4)),
}
