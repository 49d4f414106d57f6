"""Function calling through `tristream serve --token T` (the real process, socket and embedded models).

A named tool choice makes the embedded SmolLM2 call the function with arguments that match the
schema (decoded under its mask), streamed as ``response.function_call_arguments.delta`` events;
the client's ``function_call_output`` then shapes the next answer. Bad tools, a bad choice,
malformed client-made arguments and an unknown call id each get a coded error, and the session
and server go on.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tests.serve.test_default_server import TOKEN, is_type, run, server, until
from tristream.serve.client import RealtimeClient

pytestmark = pytest.mark.slow
__all__ = ["server"]  # the real `tristream serve` process, one per module

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}
TIMER = {"type": "function", "name": "set_timer", "description": "Start a countdown timer",
         "parameters": {"type": "object", "properties": {"minutes": {"type": "integer", "minimum": 0}},
                        "required": ["minutes"]}}


async def text_session(url: str, **session: Any) -> RealtimeClient:
    c = await RealtimeClient.connect(url, TOKEN)
    await c.send({"type": "session.update", "session": {"modalities": ["text"], **session}})
    await until(c, is_type("session.updated"))
    return c


async def say(c: RealtimeClient, text: str) -> None:
    await c.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
    await until(c, is_type("conversation.item.created"))


def test_named_function_call_then_its_output_shapes_the_answer(server: str) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(server, TOKEN)
        await c.send({"type": "session.update", "session": {
            "modalities": ["text"], "tools": [WEATHER, TIMER],
            "tool_choice": {"type": "function", "name": "get_weather"}}})
        upd = (await until(c, is_type("session.updated")))[-1]["session"]
        assert [t["name"] for t in upd["tools"]] == ["get_weather", "set_timer"]
        assert upd["tool_choice"] == {"type": "function", "name": "get_weather"}
        await say(c, "What's the weather in Paris?")
        await c.send({"type": "response.create"})
        evs = await until(c, is_type("response.done"))
        kinds = [e["type"] for e in evs]
        assert "response.text.delta" not in kinds, kinds  # a call only: no message item, nothing spoken
        added = next(e for e in evs if e["type"] == "response.output_item.added")
        assert added["item"]["type"] == "function_call" and added["item"]["name"] == "get_weather"
        deltas = [e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta"]
        done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
        assert len(deltas) > 1 and "".join(deltas) == done["arguments"]
        args = json.loads(done["arguments"])
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        assert isinstance(args["city"], str) and args["city"]
        resp = evs[-1]["response"]
        assert resp["status"] == "completed" and [o["type"] for o in resp["output"]] == ["function_call"]
        call = resp["output"][0]
        assert call["call_id"] == done["call_id"] and call["arguments"] == done["arguments"]

        await c.send({"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": call["call_id"],
            "output": json.dumps({"temperature": 31, "condition": "sunny"})}})
        created = (await until(c, is_type("conversation.item.created")))[-1]["item"]
        assert created["type"] == "function_call_output" and created["call_id"] == call["call_id"]
        await c.send({"type": "response.create", "response": {"tool_choice": "auto"}})
        evs = await until(c, is_type("response.done"))
        text = next(e["text"] for e in evs if e["type"] == "response.text.done")
        assert "sunny" in text.lower() or "31" in text, text
        assert [o["type"] for o in evs[-1]["response"]["output"]] == ["message"]
        await c.close()

    run(go())


def test_required_choice_picks_among_the_tools(server: str) -> None:
    async def go() -> None:
        c = await text_session(server, tools=[WEATHER, TIMER], tool_choice="required")
        await say(c, "Set a timer for 10 minutes.")
        await c.send({"type": "response.create"})
        evs = await until(c, is_type("response.done"))
        done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
        assert done["name"] in ("get_weather", "set_timer")
        args = json.loads(done["arguments"])
        schema = (WEATHER if done["name"] == "get_weather" else TIMER)["parameters"]
        assert set(schema["required"]) <= set(args) <= set(schema["properties"])
        await c.close()

    run(go())


def test_bad_tools_and_malformed_arguments_are_coded_errors_and_the_server_goes_on(server: str) -> None:
    async def go() -> None:
        c = await text_session(server)
        bad = {**WEATHER, "parameters": {"type": "object", "properties": {"x": {"$ref": "#/defs/x"}}}}
        await c.send({"type": "session.update", "session": {"tools": [bad]}})
        err = (await until(c, is_type("error"), errors_ok=True))[-1]["error"]
        assert err["code"] == "invalid_value" and err["param"] == "session.tools[0].parameters", err
        assert "$ref" in err["message"]
        await c.send({"type": "session.update", "session": {"tools": [WEATHER],
                                                            "tool_choice": {"type": "function", "name": "nope"}}})
        err = (await until(c, is_type("error"), errors_ok=True))[-1]["error"]
        assert err["param"] == "session.tool_choice" and "nope" in err["message"], err
        await c.send({"type": "conversation.item.create", "item": {
            "type": "function_call", "call_id": "call_x", "name": "get_weather", "arguments": "{city: Paris"}})
        err = (await until(c, is_type("error"), errors_ok=True))[-1]["error"]
        assert err["code"] == "invalid_value" and err["param"] == "item.arguments", err
        assert "not valid JSON" in err["message"]
        await c.send({"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": "call_unknown", "output": "{}"}})
        err = (await until(c, is_type("error"), errors_ok=True))[-1]["error"]
        assert err["param"] == "item.call_id" and "call_unknown" in err["message"], err
        # the session and the server go on: a plain question is answered
        await say(c, "What is the capital of France?")
        await c.send({"type": "response.create"})
        evs = await until(c, is_type("response.done"))
        assert evs[-1]["response"]["status"] == "completed"
        assert next(e["text"] for e in evs if e["type"] == "response.text.done").strip()
        await c.close()

    run(go())
    port = server.rsplit(":", 1)[1].split("/")[0]
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200


def test_a_spoken_request_calls_the_named_function(server: str) -> None:
    import numpy as np

    from tristream.serve.client import stream_media
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges
    from tristream.stages.tts import PiperTTS

    tts = PiperTTS(deterministic=True)
    clip = resample(tts.synthesize("What is the weather in Paris?"), tts.sample_rate, 24_000)
    a, b = energy_edges(clip, 24_000)
    pcm = np.concatenate([np.zeros(12_000, np.float32), clip[a:b], np.zeros(24_000, np.float32)]) * 32767
    events: list[dict[str, Any]] = []
    res = run(stream_media(server, TOKEN, pcm.astype(np.int16), 24_000, pace=1.0, expect_turns=1,
                           tail_silence_s=0.5, answer_timeout_s=240, on_event=events.append,
                           session={"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}))
    assert len(res) == 1 and res[0].status == "completed"
    assert "paris" in res[0].transcript.lower(), res[0].transcript
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert set(json.loads(done["arguments"])) == {"city", "unit"}
    assert not any(e["type"] == "response.audio.delta" for e in events)  # a call is not spoken


def test_the_official_openai_realtime_client_runs_a_function_call(server: str) -> None:
    """Our events parse as the `openai` package's typed Realtime events (beta), calls included."""
    openai = pytest.importorskip("openai")

    async def go() -> None:
        base = server.removesuffix("/realtime")
        client = openai.AsyncOpenAI(api_key=TOKEN, websocket_base_url=base)
        async with client.beta.realtime.connect(model="tristream-embedded") as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.session.update(session={"modalities": ["text"], "tools": [WEATHER],
                                               "tool_choice": "required"})
            ev = await conn.recv()
            assert ev.type == "session.updated" and ev.session.tools[0].name == "get_weather"
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What's the weather in Oslo?"}]})
            await conn.response.create()
            call = None
            async for ev in conn:
                assert ev.type != "error", ev
                if ev.type == "response.function_call_arguments.done":
                    call = ev
                if ev.type == "response.done":
                    assert ev.response.output[0].type == "function_call"
                    break
            assert call is not None and set(json.loads(call.arguments)) == {"city", "unit"}
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                      "output": '{"temperature": -3, "condition": "snow"}'})
            await conn.response.create(response={"tool_choice": "auto"})
            text = ""
            async for ev in conn:
                assert ev.type != "error", ev
                if ev.type == "response.text.delta":
                    text += ev.delta
                elif ev.type == "response.done":
                    break
            assert text.strip()

    run(go())
