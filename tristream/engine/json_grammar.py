"""JSON schema -> grammar nodes, and the byte-level pushdown machine that runs them (`constrain`).

A JSON schema (objects with typed properties, enums and consts, strings, numbers, integers,
booleans, null, arrays, ``anyOf`` / type lists) compiles to a small grammar (`Lit`, `Seq`,
`Alt`, `Obj`, `Arr`, `Str`, `Num` nodes). A configuration of the machine is a stack of
immutable frames (top last); a `State` is the set of live configurations, so alternatives are
followed side by side until the bytes decide. The output is compact JSON with at most one
space after ``:`` and ``,``; keys are the schema's (any order, each once, ``}`` only after the
required ones); strings are capped by ``maxLength`` (default 200 bytes), arrays by
``maxItems`` (default 8), numbers at 15 digits, no exponent.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

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
