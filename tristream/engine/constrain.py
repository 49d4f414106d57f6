"""JSON-schema constrained decoding: token masks over a tokenizer's vocabulary for a `json_grammar`.

The mask of a state comes from a walk of the vocabulary's byte trie that follows only bytes
some configuration of the machine (`json_grammar`) accepts; inside a string, the tokens made
only of plain string bytes are taken from a precomputed mask by length, so only tokens holding
``"``, ``\\`` or control bytes are walked. Masks are cached per state (string states far from
their cap share one entry). `JsonConstraint` is an engine `LogitsMask`: called with the tokens
generated so far, it advances over the new ones and returns the allowed next tokens (EOS only
once the value is complete). Not enforced (documented in docs/protocol.md): ``pattern``,
``format``, numeric bounds other than a non-negative ``minimum``, ``additionalProperties``
beyond the listed keys; ``$ref`` is refused.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from tristream.engine.json_grammar import (
    MAX_ITEMS,
    MAX_STRING,
    Alt,
    Arr,
    Lit,
    Num,
    Obj,
    Seq,
    State,
    Str,
    UnsupportedSchema,
    advance,
    advance_state,
    complete,
    schema_node,
    start,
)

__all__ = ["MAX_ITEMS", "MAX_STRING", "Alt", "Arr", "Grammar", "JsonConstraint", "Lit", "Num", "Obj", "Seq", "Str",
           "TokenVocab", "UnsupportedSchema", "grammar_for", "schema_constraint", "schema_node"]

_QUOTE, _BSLASH = 0x22, 0x5C


# ----------------------------------------------------------------------------- vocabulary
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed (the printable stand-in of each byte -> the byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _is_plain(data: bytes) -> bool:
    return all(b >= 0x20 and b != _QUOTE and b != _BSLASH for b in data)


class TokenVocab:
    """The bytes of every token of a tokenizer, as a trie for mask walks; built once per tokenizer."""

    _cache: dict[int, TokenVocab] = {}
    _lock = threading.Lock()

    def __init__(self, token_bytes: list[bytes | None], eos_ids: set[int], vocab_size: int) -> None:
        """token_bytes[i]: the bytes token i adds to the text (None: a special token, never allowed
        inside a value)."""
        self.size = max(vocab_size, len(token_bytes))
        self.token_bytes = token_bytes
        self.eos_ids = sorted(eos_ids)
        self.trie: dict[int, Any] = {}  # byte -> [children, token ids ending here]
        self.special_trie: dict[int, Any] = {}  # the same over tokens that are not plain string bytes
        by_len: dict[int, list[int]] = {}
        for tid, data in enumerate(token_bytes):
            if not data:
                continue
            self._insert(self.trie, data, tid)
            if _is_plain(data):
                by_len.setdefault(len(data), []).append(tid)
            else:
                self._insert(self.special_trie, data, tid)
        self.max_len = max(by_len) if by_len else 0
        self.plain_upto: list[torch.Tensor] = []  # [L]: plain tokens of at most L bytes
        acc = torch.zeros(self.size, dtype=torch.bool)
        for n in range(self.max_len + 1):
            if n in by_len:
                acc = acc.clone()
                acc[torch.tensor(by_len[n])] = True
            self.plain_upto.append(acc)

    @staticmethod
    def _insert(trie: dict[int, Any], data: bytes, tid: int) -> None:
        node: list[Any] = [trie, []]
        for b in data:
            node = node[0].setdefault(b, [{}, []])
        node[1].append(tid)

    @classmethod
    def of(cls, tokenizer: Any, eos_ids: set[int], vocab_size: int = 0) -> TokenVocab:
        """The vocabulary of a `tristream.engine.tokenizer.Tokenizer` (cached per tokenizer object)."""
        key = id(tokenizer)
        with cls._lock:
            got = cls._cache.get(key)
            if got is None or got.size < vocab_size:
                got = cls._cache[key] = cls(token_bytes_of(tokenizer), eos_ids, vocab_size)
            return got


def token_bytes_of(tokenizer: Any) -> list[bytes | None]:
    """The bytes each token id stands for (None for special/added tokens)."""
    backend = tokenizer.backend
    if backend is None:  # a transformers tokenizer: decode ids one by one (no byte fallback)
        hf = tokenizer.hf
        specials = set(hf.all_special_ids)
        return [None if i in specials else hf.decode([i]).encode() for i in range(len(hf))]
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1
    out: list[bytes | None] = [None] * size
    added = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    byte_level = type(backend.decoder).__name__ == "ByteLevel"
    dec = _byte_decoder() if byte_level else {}
    for piece, tid in vocab.items():
        if tid in added:
            continue
        if byte_level:
            try:
                out[tid] = bytes(dec[ch] for ch in piece)
            except KeyError:
                out[tid] = piece.encode()
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[tid] = bytes([int(piece[3:5], 16)])
        else:
            out[tid] = piece.replace("\u2581", " ").encode()
    return out


# ---------------------------------------------------------------------------- the mask
class Grammar:
    """A compiled grammar with its per-state mask cache (share one per schema and vocabulary)."""

    def __init__(self, root: Any, vocab: TokenVocab) -> None:
        self.root = root
        self.vocab = vocab
        self.initial: State = frozenset(start(root))
        self._masks: dict[State, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.walks = 0  # masks computed (cache misses)

    def _key(self, state: State) -> State:
        """States whose masks are equal share a key: string counts far from their cap are dropped."""
        m = self.vocab.max_len
        out = set()
        for s in state:
            top = s[-1] if s else None
            if top is not None and top[0] == "str" and top[3] == 0 and top[1] - top[2] >= m:
                s = s[:-1] + (("str", top[1], -2, 0),)
            out.add(s)
        return frozenset(out)

    def mask(self, state: State) -> torch.Tensor:
        """Bool [vocab]: the tokens whose bytes keep `state` alive (EOS where it is complete)."""
        key = self._key(state)
        got = self._masks.get(key)
        if got is not None:
            return got
        allowed = self._walk(state)
        with self._lock:
            self._masks[key] = allowed
            self.walks += 1
        return allowed

    def _walk(self, state: State) -> torch.Tensor:
        v = self.vocab
        ids: list[int] = []
        base: torch.Tensor | None = None
        trie = v.trie
        plain = [s for s in state if s and s[-1][0] == "str" and s[-1][3] == 0]
        if len(plain) == len(state) and len(state) == 1:
            top = plain[0][-1]
            base = v.plain_upto[min(top[1] - top[2], v.max_len)]
            trie = v.special_trie
        stack: list[tuple[dict[int, Any], list[tuple[Any, ...]]]] = [(trie, list(state))]
        while stack:
            children, configs = stack.pop()
            for b, (sub, ends) in children.items():
                nxt: list[tuple[Any, ...]] = []
                for cfg in configs:
                    nxt.extend(advance(cfg, b))
                if not nxt:
                    continue
                if ends:
                    ids.extend(ends)
                if sub:
                    stack.append((sub, list(set(nxt))))
        out = torch.zeros(v.size, dtype=torch.bool) if base is None else base.clone()
        if ids:
            out[torch.tensor(ids)] = True
        if any(complete(s) for s in state):
            out[torch.tensor(v.eos_ids, dtype=torch.long)] = True
        if not out.any():  # cannot happen for a well-formed grammar; never leave a row with nothing
            out[torch.tensor(v.eos_ids, dtype=torch.long)] = True
        return out


class JsonConstraint:
    """An engine `LogitsMask` for one request: the output must be one value of `grammar`, then EOS.

    Called on the engine thread before each sampling step with the sequence's generated token
    ids; `text` is the output so far and `done` says the value is complete.
    """

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.state: State = grammar.initial
        self.seen = 0
        self.data = bytearray()
        self.failed = False  # a token outside the grammar was accepted (the mask was bypassed)

    @property
    def done(self) -> bool:
        """Whether the output is one complete value."""
        return any(complete(s) for s in self.state)

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")

    def __call__(self, output_ids: list[int]) -> torch.Tensor | None:
        g = self.grammar
        for tid in output_ids[self.seen:]:
            piece = g.vocab.token_bytes[tid] if 0 <= tid < len(g.vocab.token_bytes) else None
            if piece is None:
                continue  # EOS / special: generation ends there
            nxt = advance_state(self.state, piece)
            if not nxt:
                self.failed = True
                break
            self.state = nxt
            self.data += piece
        self.seen = len(output_ids)
        return g.mask(self.state)


_GRAMMARS: dict[tuple[int, str], Grammar] = {}
_GLOCK = threading.Lock()


def grammar_for(key: str, build: Any, vocab: TokenVocab) -> Grammar:
    """The cached `Grammar` named `key` (e.g. a schema's JSON) over `vocab`; `build()` makes its root."""
    k = (id(vocab), key)
    with _GLOCK:
        g = _GRAMMARS.get(k)
        if g is None:
            if len(_GRAMMARS) > 256:
                _GRAMMARS.clear()
            g = _GRAMMARS[k] = Grammar(build(), vocab)
        return g


def schema_constraint(schema: dict[str, Any], tokenizer: Any, eos_ids: set[int], vocab_size: int = 0
                      ) -> JsonConstraint:
    """A constraint to one JSON value matching `schema`."""
    vocab = TokenVocab.of(tokenizer, eos_ids, vocab_size)
    key = json.dumps(schema, sort_keys=True)
    return JsonConstraint(grammar_for(key, lambda: schema_node(schema), vocab))
