"""Tokenizer, chat template and incremental detokenisation.

Wraps a transformers fast tokenizer loaded from a model folder (for GGUF checkpoints, the
cache folder written by `gguf_loader`, which carries the GGUF's chat template).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TokenizerNotFound(FileNotFoundError):
    """The model folder carries no tokenizer files."""


class Tokenizer:
    """Encode, decode and apply the chat template of a model."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face folder or a .gguf file (via its cache folder)."""
        from transformers import AutoTokenizer

        p = Path(path)
        if p.suffix == ".gguf":
            from tristream.engine.gguf_loader import cached_gguf_folder

            p = cached_gguf_folder(p)
        if not any((p / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise TokenizerNotFound(f"{p} has no tokenizer.json / tokenizer.model; cannot encode text")
        return cls(AutoTokenizer.from_pretrained(str(p)))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered through the model's chat template."""
        if not getattr(self.hf, "chat_template", None):
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return self.encode(text + ("assistant: " if add_generation_prompt else ""))
        out = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(x) for x in out]

    def special_ids(self) -> set[int]:
        return set(int(i) for i in getattr(self.hf, "all_special_ids", []))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back partial UTF-8 runes."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (may be empty)."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
