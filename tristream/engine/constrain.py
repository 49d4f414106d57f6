"""JSON-schema constrained decoding: a byte-level pushdown automaton and a token mask per state.

A JSON schema (objects with typed properties, enums and consts, strings, numbers, integers,
booleans, null, arrays, ``anyOf`` / type lists) compiles to a small grammar (`Lit`, `Seq`,
`Alt`, `Obj`, `Arr`, `Str`, `Num` nodes). Decoding runs a nondeterministic pushdown machine
over the *bytes* of the output: a configuration is a stack of immutable frames, a state the
set of live configurations (alternatives are followed side by side until the bytes decide).
The output is compact JSON with at most one space after ``:`` and ``,``; keys are the
schema's (any order, each once, ``}`` only after the required ones); strings are capped by
``maxLength`` (default 200 bytes), arrays by ``maxItems`` (default 8), numbers at 15 digits.

The mask of a state comes from a walk of the vocabulary's byte trie that follows only bytes
some configuration accepts; inside a string, the tokens made only of plain string bytes are
taken from a precomputed mask by length, so only tokens holding ``"``, ``\\`` or control bytes
are walked. Masks are cached per state (string states far from their cap share one entry).
`JsonConstraint` is an engine `LogitsMask`: called with the tokens generated so far, it
advances over the new ones and returns the allowed next tokens (EOS only once the value is
complete). Not enforced (documented in docs/protocol.md): ``pattern``, ``format``, numeric
bounds other than a non-negative ``minimum``, ``additionalProperties`` beyond the listed
keys, ``$ref``.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

import torch

MAX_STRING = 200
MAX_ITEMS = 8
MAX_DIGITS = 15


class UnsupportedSchema(ValueError):
    """A JSON schema this module cannot turn into a grammar; the message names the part."""


# ---------------------------------------------------------------------------- grammar nodes
@dataclasses.dataclass(eq=False, slots=True)
class Lit:
    """Exactly these bytes."""

    text: bytes


@dataclasses.dataclass(eq=False, slots=True)
class Seq:
    """The items one after the other."""

    items: tuple[Any, ...]


@dataclasses.dataclass(eq=False, slots=True)
class Alt:
    """Any one of the options."""

    options: tuple[Any, ...]


@dataclasses.dataclass(eq=False, slots=True)
class Str:
    """A JSON string of at most `max_len` content bytes (an escape counts as one)."""

    max_len: int = MAX_STRING


@dataclasses.dataclass(eq=False, slots=True)
class Num:
    """A JSON number without exponent; `integer`: no fraction; `nonneg`: no minus sign."""

    integer: bool = False
    nonneg: bool = False


@dataclasses.dataclass(eq=False, slots=True)
class Obj:
    """An object with the given keys (JSON-encoded, quotes included) and value nodes."""

    keys: tuple[bytes, ...]
    values: tuple[Any, ...]
    required: frozenset[int]


@dataclasses.dataclass(eq=False, slots=True)
class Arr:
    """An array of `item` values, `min_items`..`max_items` of them."""

    item: Any
    min_items: int = 0
    max_items: int = MAX_ITEMS


def _scalar() -> Alt:
    return Alt((Str(), Num(), Lit(b"true"), Lit(b"false"), Lit(b"null")))


def schema_node(schema: Any, path: str = "$") -> Any:
    """The grammar node of a JSON schema (`UnsupportedSchema` for parts it cannot express)."""
    if schema is True or schema == {}:
        return _scalar()
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"{path}: a schema must be an object, got {type(schema).__name__}")
    if "$ref" in schema:
        raise UnsupportedSchema(f"{path}: '$ref' is not supported; inline the referenced schema")
    if "const" in schema:
        return Lit(json.dumps(schema["const"], ensure_ascii=False).encode())
    if "enum" in schema:
        vals = schema["enum"]
        if not isinstance(vals, list) or not vals:
            raise UnsupportedSchema(f"{path}.enum must be a non-empty list")
        return Alt(tuple(Lit(json.dumps(v, ensure_ascii=False).encode()) for v in vals))
    for key in ("anyOf", "oneOf"):
        if key in schema:
            opts = schema[key]
            if not isinstance(opts, list) or not opts:
                raise UnsupportedSchema(f"{path}.{key} must be a non-empty list")
            return Alt(tuple(schema_node(o, f"{path}.{key}[{i}]") for i, o in enumerate(opts)))
    typ = schema.get("type")
    if typ is None:
        typ = "object" if "properties" in schema else "array" if "items" in schema else None
    if typ is None:
        return _scalar()
    if isinstance(typ, list):
        if not typ:
            raise UnsupportedSchema(f"{path}.type must not be empty")
        return Alt(tuple(schema_node({**schema, "type": t}, path) for t in typ))
    if typ == "string":
        n = schema.get("maxLength", MAX_STRING)
        if not isinstance(n, int) or n < 0:
            raise UnsupportedSchema(f"{path}.maxLength must be a non-negative integer")
        return Str(min(n, MAX_STRING))
    if typ in ("number", "integer"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return Num(integer=typ == "integer", nonneg=isinstance(low, (int, float)) and low >= 0)
    if typ == "boolean":
        return Alt((Lit(b"true"), Lit(b"false")))
    if typ == "null":
        return Lit(b"null")
    if typ == "array":
        items = schema.get("items", {})
        lo, hi = schema.get("minItems", 0), schema.get("maxItems", MAX_ITEMS)
        if not isinstance(lo, int) or not isinstance(hi, int) or not 0 <= lo <= hi:
            raise UnsupportedSchema(f"{path}: minItems/maxItems must be integers with 0 <= minItems <= maxItems")
        return Arr(schema_node(items, f"{path}.items"), lo, max(lo, min(hi, MAX_ITEMS)))
    if typ == "object":
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise UnsupportedSchema(f"{path}.properties must be an object")
        names = list(props)
        req = schema.get("required") or []
        if not isinstance(req, list) or any(r not in props for r in req):
            missing = [r for r in req if r not in props] if isinstance(req, list) else req
            raise UnsupportedSchema(f"{path}.required names properties that are not defined: {missing}")
        return Obj(tuple(json.dumps(k, ensure_ascii=False).encode() for k in names),
                   tuple(schema_node(props[k], f"{path}.properties.{k}") for k in names),
                   frozenset(names.index(r) for r in req))
    raise UnsupportedSchema(f"{path}.type {typ!r} is not a JSON schema type")


# ------------------------------------------------------------------------------ the machine
# A frame is a tuple whose first item names its kind; a stack is a tuple of frames (top last).
_DONE = "done"  # the frame consumed the byte and is complete
_PASS = "pass"  # the frame is complete without the byte: the byte goes to the frame below
_QUOTE, _BSLASH, _SPACE = 0x22, 0x5C, 0x20
_DIGITS = frozenset(range(0x30, 0x3A))
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')


def start(node: Any) -> list[tuple[Any, ...]]:
    """The alternative frame lists (bottom first) that begin `node`."""
    if isinstance(node, Lit):
        return [(("lit", node.text, 0),)]
    if isinstance(node, Str):
        return [(("str", node.max_len, 0, -1),)]
    if isinstance(node, Num):
        return [(("num", node, "start", 0),)]
    if isinstance(node, Obj):
        return [(("obj", node, frozenset(), "open", None),)]
    if isinstance(node, Arr):
        return [(("arr", node, 0, "open"),)]
    if isinstance(node, Alt):
        return [f for o in node.options for f in start(o)]
    if isinstance(node, Seq):
        return [(("seq", node, 0), *f) for f in start(node.items[0])]
    raise TypeError(f"not a grammar node: {node!r}")


def _child_done(frame: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """What a frame becomes when the frame above it completes (an empty list item: it completes too)."""
    kind = frame[0]
    if kind == "seq":
        node, i = frame[1], frame[2] + 1
        if i == len(node.items):
            return [()]
        return [(("seq", node, i), *f) for f in start(node.items[i])]
    if kind == "obj":
        return [(("obj", frame[1], frame[2], "next", None),)]
    if kind == "arr":
        return [(("arr", frame[1], frame[2] + 1, "next"),)]
    raise AssertionError(f"frame {kind} has no children")


def _step(frame: tuple[Any, ...], c: int) -> list[Any]:
    """Outcomes of byte `c` on a top frame: a tuple of frames replacing it (consumed), `_DONE`, `_PASS`,
    or ("eps", frames) (replaced without consuming: the byte goes to the new top)."""
    kind = frame[0]
    if kind == "lit":
        text, pos = frame[1], frame[2]
        if text[pos] != c:
            return []
        return [_DONE] if pos + 1 == len(text) else [(("lit", text, pos + 1),)]
    if kind == "ws":
        return [_DONE] if c == _SPACE else [_PASS]
    if kind == "str":
        cap, n, st = frame[1], frame[2], frame[3]
        if st == 0:
            if c == _QUOTE:
                return [_DONE]
            if n >= cap or c < 0x20:
                return []
            if c == _BSLASH:
                return [(("str", cap, n, 1),)]
            return [(("str", cap, n + 1, 0),)]
        if st == -1:
            return [(("str", cap, 0, 0),)] if c == _QUOTE else []
        if st == 1:
            if c in _ESCAPES:
                return [(("str", cap, n + 1, 0),)]
            return [(("str", cap, n, 2),)] if c == 0x75 else []
        if c not in _HEX:
            return []
        return [(("str", cap, n + 1, 0),)] if st == 5 else [(("str", cap, n, st + 1),)]
    if kind == "num":
        return _num(frame, c)
    if kind == "obj":
        return _obj(frame, c)
    if kind == "arr":
        node, count, phase = frame[1], frame[2], frame[3]
        if phase == "open":
            return [(("arr", node, count, "first"),)] if c == 0x5B else []
        if phase == "first" or phase == "comma":
            out: list[Any] = [("eps", (("arr", node, count, "inval"), *f)) for f in start(node.item)]
            if phase == "first" and c == 0x5D and node.min_items == 0:
                out.append(_DONE)
            return out
        if phase == "next":
            if c == 0x2C and count < node.max_items:
                return [(("arr", node, count, "comma"), ("ws",))]
            return [_DONE] if c == 0x5D and count >= node.min_items else []
        return []
    raise AssertionError(f"frame {kind} reads no bytes")


def _num(frame: tuple[Any, ...], c: int) -> list[Any]:
    node, phase, n = frame[1], frame[2], frame[3]
    digit = c in _DIGITS

    def to(p: str) -> list[Any]:
        return [(("num", node, p, n + 1),)]

    if phase == "start":
        if c == 0x2D and not node.nonneg:
            return to("minus")
        return to("zero") if c == 0x30 else to("int") if digit else []
    if phase == "minus":
        return to("zero") if c == 0x30 else to("int") if digit else []
    if phase == "dot":
        return to("frac") if digit else []
    if phase in ("zero", "int", "frac"):
        if digit and phase != "zero":
            return to(phase) if n < MAX_DIGITS else []
        if c == 0x2E and phase != "frac" and not node.integer:
            return to("dot")
        return [_PASS]
    return []


def _obj(frame: tuple[Any, ...], c: int) -> list[Any]:
    node, seen, phase, extra = frame[1], frame[2], frame[3], frame[4]
    if phase == "open":
        return [(("obj", node, seen, "first", None),)] if c == 0x7B else []
    if phase in ("first", "comma"):
        out: list[Any] = []
        if c == _QUOTE:
            cands = tuple(i for i in range(len(node.keys)) if i not in seen)
            if cands:
                out.append((("obj", node, seen, "key", (cands, 1)),))
        if phase == "first" and c == 0x7D and node.required <= seen:
            out.append(_DONE)
        return out
    if phase == "key":
        cands, pos = extra
        left = tuple(i for i in cands if len(node.keys[i]) > pos and node.keys[i][pos] == c)
        if not left:
            return []
        if len(left) == 1 and len(node.keys[left[0]]) == pos + 1:
            return [(("obj", node, seen | {left[0]}, "colon", left[0]),)]
        return [(("obj", node, seen, "key", (left, pos + 1)),)]
    if phase == "colon":
        if c != 0x3A:
            return []
        return [(("obj", node, seen, "inval", None), *f, ("ws",)) for f in start(node.values[extra])]
    if phase == "next":
        if c == 0x2C and len(seen) < len(node.keys):
            return [(("obj", node, seen, "comma", None), ("ws",))]
        return [_DONE] if c == 0x7D and node.required <= seen else []
    return []


def _pop(stack: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """Stacks after the top frame completed (the frames below notified, cascading)."""
    rest = stack[:-1]
    if not rest:
        return [()]
    if stack[-1][0] == "ws":  # whitespace completes silently
        return [rest]
    out: list[tuple[Any, ...]] = []
    for repl in _child_done(rest[-1]):
        if repl == ():
            out.extend(_pop(rest))
        else:
            out.append(rest[:-1] + repl)
    return out


def advance(stack: tuple[Any, ...], c: int) -> list[tuple[Any, ...]]:
    """The stacks after byte `c` (none: the byte is not allowed here; `()` is a complete value)."""
    if not stack:
        return []
    out: list[tuple[Any, ...]] = []
    for r in _step(stack[-1], c):
        if r is _DONE:
            out.extend(_pop(stack))
        elif r is _PASS:
            for s in _pop(stack):
                out.extend(advance(s, c))
        elif r[0] == "eps":
            out.extend(advance(stack[:-1] + r[1], c))
        else:
            out.append(stack[:-1] + r)
    return out


def complete(stack: tuple[Any, ...]) -> bool:
    """Whether the value can end here (a number ends by whatever follows it)."""
    if not stack:
        return True
    top = stack[-1]
    if top[0] == "ws" or (top[0] == "num" and top[2] in ("zero", "int", "frac")):
        return any(complete(s) for s in _pop(stack))
    return False


State = frozenset[tuple[Any, ...]]


def advance_state(state: State, data: bytes) -> State:
    """The state after `data` (empty: `data` left the grammar)."""
    cur = set(state)
    for c in data:
        nxt: set[tuple[Any, ...]] = set()
        for s in cur:
            nxt.update(advance(s, c))
        if not nxt:
            return frozenset()
        cur = nxt
    return frozenset(cur)


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
