"""Function-call arguments from the embedded model: valid JSON matching the schema, constrained vs not.

    python bench/tools.py [--quant auto] [--model PATH] [--no-baseline]

40 requests (10 functions with different schemas: strings, enums, integers, numbers,
booleans, arrays, a nested object, optional fields; 4 user requests each) go through
`tristream.serve.tools.ToolCaller` on the engine the server uses (`load_engine`, embedded
SmolLM2-135M-Instruct by default) with ``tool_choice`` naming the function: the prompt ends
with the call's opening and the arguments are decoded under the schema's token mask. Each
result is checked by `jsonschema` (an independent validator) against the function's schema.
The baseline decodes the same prompts without the mask (the same call opening, greedy,
``max_tokens`` 96) and checks the first JSON value it writes; the auto pass asks with
``tool_choice`` auto and counts the answers that call the function (and their validity). The
router pass tries candidates for ``auto`` with a small model: a separate question per request
whose answer is masked to two options (yes/no, or the function's name/"talk"), on the 40
requests and 20 that need no function (``--only-router``: just that pass, printed).
Writes bench/results/tools.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import cpu_info, git_commit, write_results  # noqa: E402

S = {"type": "string"}
FUNCTIONS: list[tuple[dict[str, Any], list[str]]] = [
    ({"name": "get_weather", "description": "Current weather in a city",
      "parameters": {"type": "object", "properties": {
          "city": S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}},
     ["What's the weather in Paris?", "Is it cold in Oslo right now, in fahrenheit?",
      "Tell me the temperature in Tokyo.", "How hot is it in Cairo today?"]),
    ({"name": "set_timer", "description": "Start a countdown timer",
      "parameters": {"type": "object", "properties": {
          "minutes": {"type": "integer", "minimum": 0}, "label": S}, "required": ["minutes"]}},
     ["Set a timer for 10 minutes.", "Timer for half an hour for the pasta please.",
      "Remind me in 3 minutes.", "Start a 45 minute timer called workout."]),
    ({"name": "play_music", "description": "Play music",
      "parameters": {"type": "object", "properties": {
          "artist": S, "genre": {"type": "string", "enum": ["rock", "jazz", "pop", "classical"]},
          "shuffle": {"type": "boolean"}}, "required": ["genre", "shuffle"]}},
     ["Play some jazz.", "Put on random rock songs by Queen.", "I want classical music, not shuffled.",
      "Play pop music on shuffle."]),
    ({"name": "convert_currency", "description": "Convert an amount of money",
      "parameters": {"type": "object", "properties": {
          "amount": {"type": "number"}, "from": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
          "to": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]}}, "required": ["amount", "from", "to"]}},
     ["How much is 20 dollars in euros?", "Convert 1500 yen to pounds.", "What is 9.99 EUR in USD?",
      "Change 100 pounds into dollars."]),
    ({"name": "add_to_list", "description": "Add items to the shopping list",
      "parameters": {"type": "object", "properties": {
          "items": {"type": "array", "items": S, "minItems": 1, "maxItems": 6}}, "required": ["items"]}},
     ["Add milk and eggs to my shopping list.", "Put bread on the list.",
      "I need apples, bananas and rice.", "Add coffee, sugar and two lemons to the list."]),
    ({"name": "book_table", "description": "Book a restaurant table",
      "parameters": {"type": "object", "properties": {
          "restaurant": S, "people": {"type": "integer", "minimum": 1}, "time": S,
          "outdoor": {"type": "boolean"}}, "required": ["restaurant", "people", "time"]}},
     ["Book a table for two at Luigi's at 7 pm.", "Reserve Sushi Bar for 4 people tomorrow at noon, outside.",
      "Table for six at The Oak, 8:30.", "Can you get me a table at Chez Marie for 3 at 19:00?"]),
    ({"name": "set_thermostat", "description": "Set the heating",
      "parameters": {"type": "object", "properties": {
          "room": {"type": "string", "enum": ["living room", "bedroom", "kitchen", "office"]},
          "celsius": {"type": "number"}}, "required": ["room", "celsius"]}},
     ["Make the bedroom 21 degrees.", "Set the office to 19.5.", "Warm the kitchen up to 23 degrees.",
      "Living room at 20 please."]),
    ({"name": "send_message", "description": "Send a text message",
      "parameters": {"type": "object", "properties": {
          "to": S, "text": {"type": "string", "maxLength": 120},
          "urgent": {"type": "boolean"}}, "required": ["to", "text"]}},
     ["Text Anna that I'm running late.", "Tell Bob the meeting moved to 3 pm, it's urgent.",
      "Send mum a message saying happy birthday.", "Message Carlos: see you at the station."]),
    ({"name": "create_event", "description": "Add a calendar event",
      "parameters": {"type": "object", "properties": {
          "title": S, "when": {"type": "object", "properties": {
              "date": S, "hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["date", "hour"]},
          "attendees": {"type": "array", "items": S, "maxItems": 5}}, "required": ["title", "when"]}},
     ["Put a dentist appointment on Friday at 9.", "Schedule lunch with Sam and Lee on May 3 at 12.",
      "Add team meeting tomorrow at 14.", "Create an event called review on Monday at 10 with Ana."]),
    ({"name": "navigate", "description": "Start navigation",
      "parameters": {"type": "object", "properties": {
          "destination": S, "mode": {"type": "string", "enum": ["car", "walk", "bike", "transit"]},
          "avoid_tolls": {"type": "boolean"}, "stops": {"type": "integer", "minimum": 0}},
          "required": ["destination", "mode"]}},
     ["Take me to the airport by car.", "Walking directions to the museum.",
      "Bike route to Central Park avoiding tolls.", "Navigate to 12 Main Street by bus."]),
]
SYSTEM = "You are a helpful voice assistant that calls functions to act for the user."
NEGATIVES = ["Tell me a joke.", "What is the capital of France?", "How are you today?",
             "Who wrote Romeo and Juliet?", "What does photosynthesis mean?", "Thanks, that's all.",
             "Can you explain what a noun is?", "What's your name?", "How many legs does a spider have?",
             "Say something nice about cats."]
"""Requests that need no function: each is asked with one of the functions offered (the router pass)."""
ROUTER_PROMPTS = {
    # one yes/no question per request, answered under a mask that allows only "yes" or "no"
    "zero_shot": "You decide whether the assistant must call a function for the user's request. Answer yes "
                 "when the request asks for what the function does, no otherwise.",
    "two_shot": "You decide whether the assistant must call a function for the user's request. Answer yes "
                "when the request asks for what the function does, no otherwise.\n\n"
                "Function: get_time: Tell the current time\nRequest: What time is it?\nAnswer: yes\n\n"
                "Function: get_time: Tell the current time\nRequest: Who painted the Mona Lisa?\nAnswer: no",
    "question_two_shot": "Answer yes or no.\n\n"
                         "Request: What time is it?\nDoes the user want to tell the current time? yes\n\n"
                         "Request: Who painted the Mona Lisa?\nDoes the user want to tell the current time? no",
}
QUESTION = "question_two_shot"  # asks "Does the user want to <description>?" about the request


CHOICE_PROMPTS = {
    # pick the function's name or "talk" (answer in words), masked to those two
    "choice_zero_shot": "Pick the best action for the user's request: the function, or talk (answer in words).",
    "choice_two_shot": "Pick the best action for the user's request: the function, or talk (answer in words).\n\n"
                       "Request: What time is it?\nActions: get_time (Tell the current time), talk\nBest: get_time\n\n"
                       "Request: Who painted the Mona Lisa?\nActions: get_time (Tell the current time), talk\n"
                       "Best: talk",
}


async def route(chat: Any, caller: Any, system: str, fn: dict[str, Any], request: str, choice: bool = False) -> bool:
    """A candidate for ``tool_choice`` auto with a small model: ask whether `fn` is needed, the answer masked
    to yes/no (or, `choice`, to the function's name or "talk"), instead of hoping the free answer opens a call."""
    from tristream.engine import constrain as C
    from tristream.engine.sequence import SamplingParams

    if choice:
        name = fn["name"]
        grammar = C.grammar_for(f"router:{name}|talk", lambda: C.Alt((C.Lit(name.encode()), C.Lit(b"talk"))),
                                caller._vocab())
        user = f"Request: {request}\nActions: {name} ({fn['description']}), talk\nBest:"
    else:
        grammar = C.grammar_for("router:yes|no", lambda: C.Alt((C.Lit(b"yes"), C.Lit(b"no"))), caller._vocab())
        user = f"Function: {fn['name']}: {fn['description']}\nRequest: {request}\nAnswer:"
        if system == ROUTER_PROMPTS[QUESTION]:
            user = f"Request: {request}\nDoes the user want to {fn['description'][0].lower()}{fn['description'][1:]}?"
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    params = SamplingParams(max_tokens=12, temperature=0.0, logits_mask=C.JsonConstraint(grammar))
    text = "".join([t async for t in chat.stream(msgs, 12, params=params)]).strip()
    return text == fn["name"] if choice else text.startswith("yes")


def first_json(text: str) -> Any:
    """The first JSON value at the start of `text` (the unconstrained baseline's arguments)."""
    dec = json.JSONDecoder()
    return dec.raw_decode(text.lstrip())[0]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import jsonschema

    from tristream.engine.sequence import SamplingParams
    from tristream.pipeline.llm import EngineChatBackend
    from tristream.serve.tools import FunctionCallDone, ToolCaller, call_opening, parse_tools, with_tools

    t0 = time.perf_counter()
    chat = EngineChatBackend.load(args.model, "cpu", args.quant)
    load_s = time.perf_counter() - t0
    caller = ToolCaller(chat)
    rows: list[dict[str, Any]] = []
    for fn, requests in ([] if args.only_router else FUNCTIONS):
        tool = parse_tools([{"type": "function", **fn}])
        for q in requests:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            t = time.perf_counter()
            end = None
            async for p in caller.run(msgs, tool, fn["name"], 48):
                if isinstance(p, FunctionCallDone):
                    end = p
            dt = time.perf_counter() - t
            row: dict[str, Any] = {"function": fn["name"], "request": q, "seconds": round(dt, 3),
                                   "arguments": end.arguments if end else None}
            try:
                jsonschema.validate(json.loads(row["arguments"]), fn["parameters"])
                row["valid"] = True
            except (json.JSONDecodeError, jsonschema.ValidationError, TypeError) as e:
                row["valid"], row["error"] = False, str(e).splitlines()[0]
            if args.auto:  # tool_choice auto: does the model call the function by itself?
                ends = [p async for p in caller.run(msgs, tool, "auto", 48) if isinstance(p, FunctionCallDone)]
                row["auto_called"] = bool(ends)
                if ends:
                    try:
                        jsonschema.validate(json.loads(ends[0].arguments), fn["parameters"])
                        row["auto_valid"] = True
                    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                        row["auto_valid"], row["auto_error"] = False, str(e).splitlines()[0]
            if args.baseline:
                full = with_tools(msgs, tool, caller.fmt)
                ids = caller.prompt_ids(full, call_opening(fn["name"], caller.fmt))
                text = "".join([x async for x in chat.stream(full, 96, params=SamplingParams(max_tokens=96),
                                                               prompt_ids=ids)])
                row["baseline_text"] = text
                try:
                    jsonschema.validate(first_json(text), fn["parameters"])
                    row["baseline_valid"] = True
                except (json.JSONDecodeError, jsonschema.ValidationError, ValueError) as e:
                    row["baseline_valid"], row["baseline_error"] = False, str(e).splitlines()[0]
            rows.append(row)
            print(f"{'ok ' if row['valid'] else 'BAD'} {dt:5.2f}s {fn['name']:<17} {row['arguments']}"
                  + (f"   | baseline {'ok' if row.get('baseline_valid') else 'bad'}" if args.baseline else ""))
    router: dict[str, Any] = {}
    if args.router:
        cases = [(fn, q, True) for fn, qs in FUNCTIONS for q in qs]
        cases += [(FUNCTIONS[i % len(FUNCTIONS)][0], q, False) for i, q in enumerate(NEGATIVES)]
        # the other function's requests: relevant words, the wrong function
        cases += [(FUNCTIONS[(i + 1) % len(FUNCTIONS)][0], qs[0], False) for i, (_, qs) in enumerate(FUNCTIONS)]
        for name, system in {**ROUTER_PROMPTS, **CHOICE_PROMPTS}.items():
            t = time.perf_counter()
            said = [(fn["name"], q, want, await route(chat, caller, system, fn, q, name in CHOICE_PROMPTS))
                    for fn, q, want in cases]
            pos = [x for x in said if x[2]]
            neg = [x for x in said if not x[2]]
            router[name] = {"called_when_relevant": sum(x[3] for x in pos), "relevant": len(pos),
                            "called_when_not": sum(x[3] for x in neg), "not_relevant": len(neg),
                            "seconds_per_decision": round((time.perf_counter() - t) / len(said), 3),
                            "false_calls": [[f, q] for f, q, _, got in neg if got],
                            "missed": [[f, q] for f, q, _, got in pos if not got]}
            print(f"router {name}: called {router[name]['called_when_relevant']}/{len(pos)} relevant, "
                  f"{router[name]['called_when_not']}/{len(neg)} not relevant")
    if args.only_router:
        return {"auto_router": router}
    n = len(rows)
    valid = sum(r["valid"] for r in rows)
    out: dict[str, Any] = {
        "cpu": cpu_info(), "git_commit": git_commit(), "model": args.model or "embedded SmolLM2-135M-Instruct",
        "quant": args.quant, "load_s": round(load_s, 2), "requests": n, "valid": valid,
        "valid_rate": round(valid / n, 4),
        "seconds_per_call_median": round(statistics.median(r["seconds"] for r in rows), 3),
        "rows": rows,
    }
    if args.auto:
        out["auto_called"] = sum(r["auto_called"] for r in rows)
        out["auto_valid"] = sum(bool(r.get("auto_valid")) for r in rows)
    if router:
        out["auto_router"] = router
    if args.baseline:
        b = sum(r["baseline_valid"] for r in rows)
        out["baseline_valid"] = b
        out["baseline_valid_rate"] = round(b / n, 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2)")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false")
    ap.add_argument("--no-auto", dest="auto", action="store_false", help="skip the tool_choice=auto pass")
    ap.add_argument("--no-router", dest="router", action="store_false",
                    help="skip the yes/no router pass (a candidate for auto with a small model)")
    ap.add_argument("--only-router", action="store_true", help="only the router pass (no results file)")
    args = ap.parse_args()
    res = asyncio.run(run(args))
    if args.only_router:
        print(json.dumps(res, indent=1))
        return
    path = write_results("tools", res, extra_modules=("torch", "jsonschema"))
    print(f"constrained: {res['valid']}/{res['requests']} valid ({res['valid_rate']:.0%})"
          + (f"; unconstrained: {res['baseline_valid']}/{res['requests']}" if args.baseline else "")
          + (f"; auto: called {res['auto_called']}/{res['requests']}, valid {res['auto_valid']}" if args.auto else "")
          + f"; median {res['seconds_per_call_median']} s per call -> {path}")


if __name__ == "__main__":
    main()
