"""JSON-schema constrained decoding: the automaton, the token masks, and the engine's logits-mask hook.

Random walks pick any allowed token at every step (the harshest "model"): every finished walk
must parse and match the schema. The engine test runs a tiny random-weight model with a
synthetic byte vocabulary: its greedy output, unconstrained garbage, becomes valid JSON.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine._tiny import tiny_hf_model
from tristream.engine import constrain as C
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.loader import load_model
from tristream.engine.sequence import SamplingParams

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 0},
        "temp": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
        "note": {"type": ["string", "null"], "maxLength": 4},
    },
    "required": ["city", "unit"],
}
EOS = 0


def check(value: Any, schema: dict[str, Any]) -> None:
    """A small validator for the schema features above (independent of the grammar code)."""
    if "enum" in schema:
        assert value in schema["enum"]
        return
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
             "object": dict, "null": type(None)}
    assert any(isinstance(value, kinds[t]) and not (t in ("integer", "number") and isinstance(value, bool))
               for t in types), (value, types)
    if isinstance(value, str):
        assert len(value) <= schema.get("maxLength", C.MAX_STRING)  # characters (the cap counts bytes or escapes)
    if isinstance(value, int) and not isinstance(value, bool) and "minimum" in schema:
        assert value >= schema["minimum"]
    if isinstance(value, list):
        assert len(value) <= schema.get("maxItems", C.MAX_ITEMS)
        for v in value:
            check(v, schema["items"])
    if isinstance(value, dict):
        assert set(schema.get("required", [])) <= set(value) <= set(schema["properties"])
        for k, v in value.items():
            check(v, schema["properties"][k])


def byte_vocab() -> C.TokenVocab:
    """Id 0 = EOS; 1..95 the printable ASCII bytes; then a few multi-byte pieces as a BPE would have."""
    pieces: list[bytes | None] = [None] + [bytes([b]) for b in range(0x20, 0x7F)]
    pieces += [b'{"', b'":', b'", "', b'true', b'false', b'null', b'celsius', b'"}', b'12', b'.5', b'\\"', b'"]',
               b'["', b'\\u00e9', b'abc"', b'": "', b', "', b'}}', b'\xc3\xa9']
    return C.TokenVocab(pieces, {EOS}, 300)


def walk(grammar: C.Grammar, rng: random.Random, limit: int = 400) -> tuple[str, C.JsonConstraint]:
    c = C.JsonConstraint(grammar)
    ids: list[int] = []
    while len(ids) < limit:
        allowed = c(ids).nonzero().flatten().tolist()
        assert allowed, "a state with no allowed token"
        tid = rng.choice(allowed)
        if tid == EOS:
            return c.text, c
        ids.append(tid)
    raise AssertionError(f"no end after {limit} tokens: {c.text!r}")


def test_random_walks_are_valid_json_matching_the_schema() -> None:
    g = C.Grammar(C.schema_node(SCHEMA), byte_vocab())
    rng = random.Random(1)
    seen_keys: set[str] = set()
    for _ in range(150):
        text, c = walk(g, rng)
        assert c.done and not c.failed
        value = json.loads(text)
        check(value, SCHEMA)
        seen_keys |= set(value)
    assert seen_keys == set(SCHEMA["properties"])  # every property is reachable
    before = g.walks
    again = walk(g, random.Random(1))[0]
    assert g.walks == before and json.loads(again)  # a state seen before costs no new trie walk


def test_masks_refuse_what_breaks_the_grammar() -> None:
    v = byte_vocab()
    g = C.Grammar(C.schema_node({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}},
                                 "required": ["n"]}), v)
    idx = {p: i for i, p in enumerate(v.token_bytes) if p is not None}
    c = C.JsonConstraint(g)
    m = c([])
    assert m[idx[b"{"]] and m[idx[b'{"']] and not m[idx[b"["]] and not m[EOS]
    ids = [idx[b'{"'], idx[b"n"], idx[b'":'], idx[b" "]]
    m = c(ids)
    assert m[idx[b"1"]] and m[idx[b"12"]] and not m[idx[b"-"]] and not m[idx[b'"']] and not m[idx[b" "]]
    ids += [idx[b"12"]]
    m = c(ids)
    assert m[idx[b"}"]] and m[idx[b"3"]] and not m[idx[b".5"]] and not m[idx[b","]]  # integer; no more keys
    ids += [idx[b"}"]]
    m = c(ids)
    assert m[EOS] and int(m.sum()) == 1
    assert json.loads(c.text) == {"n": 12}


def test_alternatives_and_whole_calls() -> None:
    """A union of calls (tool_choice 'required'): the bytes pick the branch."""
    call = C.Alt(tuple(C.Seq((C.Lit(f'{{"name": "{n}", "arguments": '.encode()), C.schema_node(s), C.Lit(b"}")))
                       for n, s in (("a", {"type": "object", "properties": {"x": {"type": "boolean"}},
                                           "required": ["x"]}),
                                    ("ab", {"type": "object", "properties": {"y": {"type": "null"}},
                                            "required": ["y"]}))))
    g = C.Grammar(call, byte_vocab())
    rng = random.Random(3)
    names = set()
    for _ in range(40):
        text, _ = walk(g, rng)
        obj = json.loads(text)
        names.add(obj["name"])
        assert obj["arguments"] == ({"x": obj["arguments"]["x"]} if obj["name"] == "a" else {"y": None})
    assert names == {"a", "ab"}


def test_unsupported_schemas_name_the_part() -> None:
    with pytest.raises(C.UnsupportedSchema, match=r"\$ref"):
        C.schema_node({"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}})
    with pytest.raises(C.UnsupportedSchema, match="required"):
        C.schema_node({"type": "object", "properties": {}, "required": ["zz"]})
    with pytest.raises(C.UnsupportedSchema, match="not a JSON schema type"):
        C.schema_node({"type": "date"})


def test_engine_hook_constrains_a_random_model(tmp_path: Path) -> None:
    tiny_hf_model("llama", tmp_path, seed=3)
    model = load_model(tmp_path)
    eng = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=128, use_graphs=False))
    eng.eos_ids = {EOS}
    vocab = byte_vocab()
    schema = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                               "n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["unit", "n", "ok"]}
    g = C.Grammar(C.schema_node(schema), vocab)
    free = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    with pytest.raises(ValueError):
        json.loads(b"".join(vocab.token_bytes[t] or b"" for t in free if t < len(vocab.token_bytes)))
    for prompt in ([5, 6, 7, 8], [40, 41], list(range(10, 60))):
        c = C.JsonConstraint(g)
        out = eng.generate([prompt], SamplingParams(max_tokens=120, logits_mask=c))[0]
        assert c.done and not c.failed and len(out) < 120
        value = json.loads(c.text)
        check(value, {**schema, "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                               "n": {"type": "integer"}, "ok": {"type": "boolean"}}})
        assert c.text.encode() == b"".join(vocab.token_bytes[t] or b"" for t in out)
    # a masked and an unmasked sequence in one batch: the mask applies to its own row only
    c = C.JsonConstraint(g)
    unmasked, masked = _beside_masked(eng, c, 30)
    assert unmasked == free  # the same greedy tokens as alone
    assert json.loads(c.text)["unit"] in ("celsius", "fahrenheit")
    assert torch.is_tensor(c(masked))


def _beside_masked(eng: LLMEngine, c: C.JsonConstraint, free_tokens: int) -> tuple[list[int], list[int]]:
    """Prompt [5, 6, 7, 8] unmasked (`free_tokens` greedy tokens) and [9, 10] under `c`, in one
    batch; each one's tokens but EOS."""
    ids = [eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=free_tokens, ignore_eos=True)),
           eng.add_request([9, 10], SamplingParams(max_tokens=120, logits_mask=c))]
    outs: dict[int, list[int]] = {i: [] for i in ids}
    while eng.has_work():
        for o in eng.step():
            if o.token_id is not None and o.token_id != EOS:
                outs[o.seq_id].append(o.token_id)
    return outs[ids[0]], outs[ids[1]]


@pytest.mark.gpu
def test_engine_hook_on_cuda_with_graphs_and_overlap(tmp_path: Path) -> None:
    """On CUDA (decode graphs, overlapped greedy decode on): a masked sequence samples from its
    graph's logits under the mask, and the unmasked one beside it keeps its overlapped greedy tokens."""
    tiny_hf_model("llama", tmp_path, seed=3)
    model = load_model(tmp_path, device="cuda", dtype=torch.float32)
    eng = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=64))
    eng.runner.capture()
    assert eng.overlap is not None
    eng.eos_ids = {EOS}
    vocab = byte_vocab()
    g = C.Grammar(C.schema_node({"type": "object", "properties": {"n": {"type": "integer"},
                                                                   "ok": {"type": "boolean"}},
                                 "required": ["n", "ok"]}), vocab)
    free = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    c = C.JsonConstraint(g)
    assert _beside_masked(eng, c, 40)[0] == free
    value = json.loads(c.text)
    assert isinstance(value["n"], int) and isinstance(value["ok"], bool) and c.done
