"""Tokenizer, chat template and incremental detokenisation.

Wraps a transformers fast tokenizer loaded from a model folder (for GGUF checkpoints, the
cache folder written by `gguf_loader`, which carries the GGUF's chat template).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TokenizerNotFound(FileNotFoundError):
    """The model folder carries no tokenizer files."""


class Tokenizer:
    """Encode, decode and apply the chat template of a model.

    With a `tokenizer.json` the `tokenizers` library and jinja2 do the work directly (no
    transformers import: that alone costs seconds at start-up); otherwise a transformers
    tokenizer is wrapped.
    """

    def __init__(self, backend: Any, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, hf: Any = None) -> None:
        self.backend = backend
        self.hf = hf
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        if hf is not None:
            self.eos_token_id: int | None = hf.eos_token_id
            self.bos_token_id: int | None = hf.bos_token_id
        else:
            self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
            self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self._template: Any = None

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face folder or a .gguf file (via its cache folder)."""
        p = Path(path)
        if p.suffix == ".gguf":
            from tristream.engine.gguf_loader import cached_gguf_folder

            p = cached_gguf_folder(p)
        if (p / "tokenizer.json").exists():
            from tokenizers import Tokenizer as FastTokenizer

            cfg: dict[str, Any] = {}
            if (p / "tokenizer_config.json").exists():
                cfg = json.loads((p / "tokenizer_config.json").read_text())
            template = cfg.get("chat_template")
            if (p / "chat_template.jinja").exists():
                template = (p / "chat_template.jinja").read_text()
            return cls(FastTokenizer.from_file(str(p / "tokenizer.json")), template,
                       _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")))
        if not any((p / n).exists() for n in ("tokenizer.model", "vocab.json")):
            raise TokenizerNotFound(f"{p} has no tokenizer.json / tokenizer.model; cannot encode text")
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(p))
        return cls(None, getattr(hf, "chat_template", None), hf.bos_token, hf.eos_token, hf=hf)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.hf is not None:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.hf is not None:
            return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as text, through the model's jinja chat template."""
        if not self.chat_template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg: str) -> None:
                raise ValueError(f"chat template: {msg}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return str(self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or ""))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered through the model's chat template."""
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


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
