"""Function calling on our engine: tool specs, the model's tool-call format, constrained calls.

- **Specs.** `parse_tools` / `parse_tool_choice` read the Realtime shape (``{"type":
  "function", "name", "description", "parameters"}``) and the Chat Completions shape
  (``{"type": "function", "function": {...}}``); each ``parameters`` schema is compiled to a
  grammar up front (`tristream.engine.constrain`), so a schema we cannot enforce is refused
  with a `ToolSpecError` naming it, before any answer.
- **Format.** The tool-call format follows the model's chat template: Llama 3.x (a header
  template) calls tools with a bare JSON object ``{"name": ..., "parameters": {...}}``;
  every other template (Qwen, Hermes, SmolLM's ChatML) with ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``. The tool list goes into the system message in that
  format's words; earlier calls and their outputs go back into the conversation as the
  assistant's call and a ``<tool_response>`` (Llama: ``ipython``) message.
- **Decoding.** `ToolCaller.run` answers one turn: with ``tool_choice`` a named function (or
  ``required`` with one tool) the prompt ends with the call's opening (``{"name": "f",
  "arguments": ``) and the arguments are decoded under the schema's mask; ``required`` with
  several tools decodes the whole call under the union of the tools' grammars; ``auto``
  decodes freely and, when the answer opens a tool call, goes on under the constraint from
  there (the prefix cache keeps the prompt); ``none`` renders no tools.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import secrets
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tristream.engine import constrain as C

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HERMES, LLAMA3 = "hermes", "llama3"
CALL_MAX_TOKENS = 256


class ToolSpecError(ValueError):
    """Bad ``tools`` / ``tool_choice`` / tool output from a client; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(slots=True)
class ToolSpec:
    """One function a model may call."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The Realtime shape (``session.tools``)."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters}


def parse_tools(raw: Any, param: str = "tools") -> list[ToolSpec]:
    """Tools from either API's shape; `ToolSpecError` for anything the engine could not call."""
    if not isinstance(raw, list):
        raise ToolSpecError(f"'{param}' must be a list of function tools", param)
    out: list[ToolSpec] = []
    for i, t in enumerate(raw):
        p = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ToolSpecError(f"{p} must be an object with type 'function' (only function tools are supported)", p)
        body: dict[str, Any] = t["function"] if isinstance(t.get("function"), dict) else t
        name = body.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolSpecError(f"{p}.name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}", f"{p}.name")
        if any(o.name == name for o in out):
            raise ToolSpecError(f"{p}.name {name!r} is defined twice", f"{p}.name")
        desc = body.get("description") or ""
        if not isinstance(desc, str):
            raise ToolSpecError(f"{p}.description must be a string", f"{p}.description")
        params = body.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolSpecError(f"{p}.parameters must be a JSON schema object", f"{p}.parameters")
        from tristream.engine import constrain as C

        try:
            node = C.schema_node(params)
        except C.UnsupportedSchema as e:
            raise ToolSpecError(f"{p}.parameters: {e}", f"{p}.parameters") from None
        if not isinstance(node, C.Obj):
            raise ToolSpecError(f"{p}.parameters must describe an object (type 'object')", f"{p}.parameters")
        out.append(ToolSpec(name, desc, params))
    return out


def parse_tool_choice(raw: Any, tools: list[ToolSpec], param: str = "tool_choice") -> str:
    """'auto', 'none', 'required' or the name of one of `tools` (either API's object shape)."""
    if raw is None:
        return "auto"
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise ToolSpecError(f"'{param}' must be 'auto', 'none', 'required' or a function", param)
        if raw == "required" and not tools:
            raise ToolSpecError(f"'{param}' is 'required' but no tools are defined", param)
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        body: dict[str, Any] = raw["function"] if isinstance(raw.get("function"), dict) else raw
        name = body.get("name")
        if not any(t.name == name for t in tools):
            raise ToolSpecError(f"'{param}' names function {name!r}, which is not among the tools "
                                f"({', '.join(t.name for t in tools) or 'none defined'})", param)
        return str(name)
    raise ToolSpecError(f"'{param}' must be 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}", param)


def choice_json(choice: str) -> Any:
    """A choice as the Realtime API shows it."""
    return choice if choice in ("auto", "none", "required") else {"type": "function", "name": choice}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(8)}"


def check_arguments(arguments: str, param: str = "arguments") -> None:
    """Arguments of a client-made function call must be a JSON object (text)."""
    try:
        val = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise ToolSpecError(f"'{param}' is not valid JSON ({e.msg} at char {e.pos}); "
                            "send the arguments as a JSON object encoded in a string", param) from None
    if not isinstance(val, dict):
        raise ToolSpecError(f"'{param}' must encode a JSON object, got {type(val).__name__}", param)


# ------------------------------------------------------------------------------ format
def tool_format(chat_template: str | None) -> str:
    """The tool-call format of a chat template: `LLAMA3` for Llama 3.x headers, else `HERMES`."""
    return LLAMA3 if chat_template and "<|start_header_id|>" in chat_template else HERMES


def tools_prompt(tools: list[ToolSpec], fmt: str) -> str:
    """The tool list and calling convention, for the system message."""
    sigs = "\n".join(json.dumps({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.parameters}}, ensure_ascii=False)
        for t in tools)
    if fmt == LLAMA3:
        return ("You have access to the following functions. To call a function, respond with a JSON object "
                'of the form {"name": function name, "parameters": dictionary of argument name and its value}. '
                f"Do not use variables.\n\n{sigs}")
    return ("You may call one or more functions to assist with the user query.\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{sigs}\n</tools>\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def call_opening(name: str, fmt: str) -> str:
    """The text of a call up to its arguments."""
    key = "parameters" if fmt == LLAMA3 else "arguments"
    lead = "" if fmt == LLAMA3 else "<tool_call>\n"
    return f'{lead}{{"name": {json.dumps(name)}, "{key}": '


def call_text(name: str, arguments: str, fmt: str) -> str:
    """A whole call as the model writes it (for the conversation history)."""
    return call_opening(name, fmt) + arguments + ("}" if fmt == LLAMA3 else "}\n</tool_call>")


def output_message(output: str, fmt: str) -> dict[str, str]:
    """A function's output as a conversation message."""
    if fmt == LLAMA3:
        return {"role": "ipython", "content": output}
    return {"role": "user", "content": f"<tool_response>\n{output}\n</tool_response>"}


def with_tools(messages: list[dict[str, str]], tools: list[ToolSpec], fmt: str) -> list[dict[str, str]]:
    """`messages` with the tool list appended to the system message (one is added if none)."""
    if not tools:
        return messages
    block = tools_prompt(tools, fmt)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


_HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*(?:</tool_call>|$)", re.DOTALL)


def parse_calls(text: str, fmt: str) -> list[tuple[str, str]]:
    """The (name, arguments JSON) calls in a model's answer (none: the answer is text)."""
    bodies: list[str]
    if fmt == LLAMA3:
        t = text.strip().removeprefix("<|python_tag|>").strip()
        bodies = [b for b in t.split(";") if b.strip()] if t.startswith("{") else []
    else:
        bodies = _HERMES_CALL.findall(text)
    out: list[tuple[str, str]] = []
    for b in bodies:
        try:
            obj = json.loads(b)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models encode the arguments as a string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                continue
        out.append((obj["name"], json.dumps(args, ensure_ascii=False)))
    return out


def opens_call(text: str, fmt: str) -> bool | None:
    """Whether an answer beginning with `text` is a tool call (None: too early to say)."""
    t = text.lstrip()
    marks = ("{", "<|python_tag|>") if fmt == LLAMA3 else ("<tool_call>",)
    if any(t.startswith(m) for m in marks):
        return True
    if not t or any(m.startswith(t) for m in marks):
        return None
    return False


# ------------------------------------------------------------------------------ decoding
@dataclasses.dataclass(slots=True)
class TextPiece:
    """Answer text."""

    text: str




@dataclasses.dataclass(slots=True)
class FunctionCallDelta:
    """Part of a call's arguments as decoded (also the backend event the server sends on)."""

    call_id: str
    name: str
    delta: str


@dataclasses.dataclass(slots=True)
class FunctionCallDone:
    """Backend event: a call the model made (`complete` False: it hit the token limit unfinished)."""

    call_id: str
    name: str
    arguments: str
    complete: bool = True


Piece = TextPiece | FunctionCallDelta | FunctionCallDone


class ToolCaller:
    """Answers turns with tools on an `EngineChatBackend` (its engine's tokenizer and thread)."""

    def __init__(self, chat: Any) -> None:
        self.chat = chat
        self.engine = chat.engine
        self.tokenizer = self.engine.tokenizer
        self.fmt = tool_format(self.tokenizer.chat_template if self.tokenizer is not None else None)

    def _vocab(self) -> C.TokenVocab:
        from tristream.engine import constrain as C

        return C.TokenVocab.of(self.tokenizer, set(self.engine.eos_ids), self.engine.model.cfg.vocab_size)

    def grammar(self, tools: list[ToolSpec], whole_call: bool) -> C.Grammar:
        """The arguments grammar of one tool, or (`whole_call`) any of `tools` as a whole call."""
        from tristream.engine import constrain as C

        vocab = self._vocab()
        if not whole_call:
            t = tools[0]
            return C.grammar_for(json.dumps(t.parameters, sort_keys=True), lambda: C.schema_node(t.parameters), vocab)
        key = "call:" + self.fmt + json.dumps([[t.name, t.parameters] for t in tools], sort_keys=True)
        opening = call_opening("", self.fmt).split('{"name"')[0]

        def build() -> Any:
            return C.Alt(tuple(C.Seq((C.Lit(call_opening(t.name, self.fmt)[len(opening):].encode()),
                                      C.schema_node(t.parameters), C.Lit(b"}"))) for t in tools))
        return C.grammar_for(key, build, vocab)

    def prompt_ids(self, messages: list[dict[str, str]], suffix: str) -> list[int]:
        return list(self.tokenizer.encode(self.tokenizer.render_chat(messages) + suffix))

    async def run(self, messages: list[dict[str, str]], tools: list[ToolSpec], choice: str,
                  max_tokens: int, params: Any = None) -> AsyncGenerator[Piece, None]:
        """The pieces of one answer to `messages` (the system message first, history rendered);
        ``params``: `SamplingParams` of a text answer (None: the chat backend's own settings)."""
        from tristream.engine.sequence import SamplingParams

        if choice == "none" or not tools:
            async with contextlib.aclosing(self.chat.stream(messages, max_tokens, params=params)) as gen:
                async for text in gen:
                    yield TextPiece(text)
            return
        msgs = with_tools(messages, tools, self.fmt)
        if choice == "auto":
            held = ""
            params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0)
            decided: bool | None = None
            gen = self.chat.stream(msgs, max_tokens, params=params)
            try:
                async for text in gen:
                    if decided is None:
                        held += text
                        decided = opens_call(held, self.fmt)
                        if decided is False:
                            yield TextPiece(held)
                        elif decided:
                            break
                    else:
                        yield TextPiece(text)
            finally:
                await gen.aclose()
            if not decided:
                if decided is None and held:
                    yield TextPiece(held)
                return
        named = [t for t in tools if t.name == choice]
        if named or len(tools) == 1:
            tool = named[0] if named else tools[0]
            async for p in self._named(msgs, tool):
                yield p
            return
        async for p in self._any(msgs, tools):
            yield p

    async def _named(self, msgs: list[dict[str, str]], tool: ToolSpec) -> AsyncGenerator[Piece, None]:
        from tristream.engine import constrain as C
        from tristream.engine.sequence import SamplingParams

        mask = C.JsonConstraint(self.grammar([tool], whole_call=False))
        params = SamplingParams(max_tokens=CALL_MAX_TOKENS, temperature=0.0, logits_mask=mask)
        call_id = new_call_id()
        ids = self.prompt_ids(msgs, call_opening(tool.name, self.fmt))
        async with contextlib.aclosing(self.chat.stream(msgs, CALL_MAX_TOKENS, params=params, prompt_ids=ids)) as gen:
            async for text in gen:
                yield FunctionCallDelta(call_id, tool.name, text)
        yield FunctionCallDone(call_id, tool.name, mask.text, mask.done and not mask.failed)

    async def _any(self, msgs: list[dict[str, str]], tools: list[ToolSpec]) -> AsyncGenerator[Piece, None]:
        """A whole call under the union of the tools' grammars; arguments stream once the name is decoded."""
        from tristream.engine import constrain as C
        from tristream.engine.sequence import SamplingParams

        mask = C.JsonConstraint(self.grammar(tools, whole_call=True))
        params = SamplingParams(max_tokens=CALL_MAX_TOKENS, temperature=0.0, logits_mask=mask)
        opening = call_opening("", self.fmt).split('{"name"')[0]
        heads = {t.name: call_opening(t.name, self.fmt)[len(opening):] for t in tools}
        ids = self.prompt_ids(msgs, opening)
        call_id, name, start, sent, acc = new_call_id(), None, 0, 0, ""
        async with contextlib.aclosing(self.chat.stream(msgs, CALL_MAX_TOKENS, params=params, prompt_ids=ids)) as gen:
            async for text in gen:
                acc += text
                if name is None:
                    name = next((n for n, h in heads.items() if acc.startswith(h)), None)
                    start = len(heads[name]) if name is not None else 0
                if name is not None:
                    body = acc[start:]
                    safe = body[:-1] if body.endswith("}") else body  # the last brace may close the call
                    if len(safe) > sent:
                        yield FunctionCallDelta(call_id, name, safe[sent:])
                        sent = len(safe)
        if name is None:
            yield FunctionCallDone(call_id, tools[0].name, mask.text, False)
            return
        body = mask.text[start:]
        args = body[:-1] if mask.done and body.endswith("}") else body
        if len(args) > sent:
            yield FunctionCallDelta(call_id, name, args[sent:])
        yield FunctionCallDone(call_id, name, args, mask.done and not mask.failed)
