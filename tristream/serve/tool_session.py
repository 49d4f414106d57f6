"""Function calling in a realtime session: the session's tools, its calls, and the LLM turn that uses them.

`ToolState` is what a session knows about tools: the tool list, ``tool_choice`` (and a
one-response override from ``response.create``), and the calls made so far with their outputs,
each anchored to the user message it answered. `ToolChat` is the session's chat backend for the
pipeline's LLM stage (`Session(llm=...)`): it renders the conversation with the tool list, the
calls and their outputs, answers through `ToolCaller` (constrained when a function is required
or named) and reports calls to the server as `FunctionCallDelta` / `FunctionCallDone` events
(the LLM stage sees no text for a call, so nothing is spoken). `ToolPipelineBackend` is the
assistant backend with a `ToolChat` per session; `tool_pipeline_factory` replaces
`pipeline_factory` for ``tristream serve``.

Rendering for templates without a tool convention (SmolLM2's ChatML, `PLAIN`): calls use the
Hermes format, and a call's outputs go back as ``Facts: ...`` in front of the user message that
led to it (SmolLM2-135M used the tool's output in 4/4 probes that way; with Hermes
``<tool_response>`` messages it repeated the response instead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from tristream.serve.backend import BackendFamily
from tristream.serve.pipeline_backend import PipelineBackend
from tristream.serve.tools import (
    HERMES,
    FunctionCallDelta,
    FunctionCallDone,
    TextPiece,
    ToolCaller,
    ToolSpec,
    ToolSpecError,
    call_text,
    output_message,
)

PLAIN = "plain"


@dataclasses.dataclass(slots=True)
class Call:
    call_id: str
    name: str
    arguments: str
    anchor: str | None  # the user message it answered
    output: str | None = None


@dataclasses.dataclass(slots=True)
class ToolState:
    """A session's tools, tool choice and calls."""

    tools: list[ToolSpec] = dataclasses.field(default_factory=list)
    choice: str = "auto"
    next_choice: str | None = None
    calls: list[Call] = dataclasses.field(default_factory=list)
    last_user: str | None = None
    max_calls: int = 64

    def take_choice(self) -> str:
        """The choice for the answer starting now (a response's override is used once)."""
        c, self.next_choice = (self.next_choice or self.choice), None
        return c

    def add_call(self, call_id: str, name: str, arguments: str) -> None:
        if any(c.call_id == call_id for c in self.calls):
            raise ToolSpecError(f"a function call with call_id {call_id!r} is already in the conversation",
                                "item.call_id")
        self.calls.append(Call(call_id, name, arguments, self.last_user))
        del self.calls[:-self.max_calls]

    def add_output(self, call_id: str, output: str) -> None:
        for c in self.calls:
            if c.call_id == call_id:
                c.output = output
                return
        known = ", ".join(c.call_id for c in self.calls[-5:]) or "none yet"
        raise ToolSpecError(f"no function call with call_id {call_id!r} in this conversation "
                            f"(latest: {known})", "item.call_id")

    def conversation(self, messages: list[dict[str, str]], fmt: str) -> list[dict[str, str]]:
        """`messages` (system, history, this turn) with the calls and outputs put back in place."""
        msgs: list[dict[str, str]] = []
        for m in messages:  # an answer asked again for the same user turn repeats its message
            if msgs and m["role"] == "user" and msgs[-1] == m:
                continue
            msgs.append(m)
        groups: dict[int | None, list[Call]] = {}
        for c in self.calls:
            at = next((j for j in range(len(msgs) - 1, -1, -1) if msgs[j]["role"] == "user" and c.anchor
                       and msgs[j]["content"].endswith(c.anchor)), None)
            if at is None and c.anchor is not None:
                continue  # its user message left the bounded history: so does the call
            groups.setdefault(at, []).append(c)
        out: list[dict[str, str]] = []
        for j, m in enumerate(msgs):
            out.extend(render_calls(m, groups[j], fmt) if j in groups else [m])
        rest = groups.get(None)
        if rest:
            last = next((j for j in range(len(out) - 1, -1, -1) if out[j]["role"] == "user"), None)
            if last is not None and fmt == PLAIN:
                out[last:last + 1] = render_calls(out[last], rest, fmt)
            else:
                out.extend(render_calls(None, rest, fmt))
        return out


def render_calls(user: dict[str, str] | None, calls: list[Call], fmt: str) -> list[dict[str, str]]:
    """A user message and the calls that answered it, as template messages."""
    done = [c for c in calls if c.output is not None]
    if fmt == PLAIN:
        if not done:
            return [user] if user is not None else []
        facts = "\n".join(c.output or "" for c in done)
        q = user["content"] if user is not None else ""
        return [{"role": "user", "content": f"Facts: {facts}\nQuestion: {q}" if q else f"Facts: {facts}"}]
    out = [user] if user is not None else []
    out.append({"role": "assistant", "content": "\n".join(call_text(c.name, c.arguments, fmt) for c in calls)})
    out.extend(output_message(c.output or "", fmt) for c in done)
    return out


def render_format(caller: ToolCaller) -> str:
    """`PLAIN` for a template without tool calls, else the template's own format."""
    tpl = caller.tokenizer.chat_template or "" if caller.tokenizer is not None else ""
    if caller.fmt == HERMES and "tool" not in tpl:
        return PLAIN
    return caller.fmt


class ToolChat:
    """One session's chat backend with tools (see the module docstring)."""

    name = "engine+tools"

    def __init__(self, inner: Any, emit: Callable[[Any], None]) -> None:
        self.inner = inner
        self.emit = emit
        self.state = ToolState()
        self.caller = ToolCaller(inner) if getattr(inner, "engine", None) is not None else None
        self.calls_made = 0

    @property
    def supported(self) -> bool:
        """Whether this LLM can call tools (our engine; an OpenAI-compatible endpoint cannot here)."""
        return self.caller is not None

    def prefill(self, key: str, messages: list[dict[str, str]] | None) -> None:
        """Incremental prefill through the inner backend while the user speaks (without tools
        only: with tools the answer's prompt is rendered differently, so it would not be reused)."""
        inner = getattr(self.inner, "prefill", None)
        if inner is not None and (messages is None or not (self.state.tools or self.state.calls)):
            inner(key, messages)

    async def stream(self, messages: list[dict[str, str]], max_tokens: int) -> AsyncIterator[str]:
        """Text of the answer; a call goes to `emit` instead (no text)."""
        st = self.state
        if messages and messages[-1]["role"] == "user":
            st.last_user = messages[-1]["content"]
        choice = st.take_choice()
        if self.caller is None or (not st.tools and not st.calls):
            async for t in self.inner.stream(messages, max_tokens):
                yield t
            return
        fmt = render_format(self.caller)
        msgs = st.conversation(messages, fmt)
        last = st.calls[-1] if st.calls else None
        if choice == "auto" and last is not None and last.output is not None and last.anchor == st.last_user:
            choice = "none"  # the turn's calls are answered: a small model answers in words (docs/protocol.md)
        gen = self.caller.run(msgs, st.tools, choice, max_tokens)
        try:
            async for p in gen:
                if isinstance(p, TextPiece):
                    yield p.text
                elif isinstance(p, FunctionCallDelta):
                    self.emit(p)
                else:
                    self.calls_made += 1
                    st.add_call(p.call_id, p.name, p.arguments)
                    self.emit(p)
        finally:
            await gen.aclose()

    def close(self) -> None:
        """Nothing of its own to free (the engine is shared)."""


class ToolPipelineBackend(PipelineBackend):
    """The assistant backend whose LLM turns can call the session's tools (`tool_state`)."""

    def __init__(self, models: Any, **kw: Any) -> None:
        self.tool_chat = ToolChat(models.llm, self._emit_tool)
        super().__init__(models, chat_for_session=lambda _tier: self.tool_chat, **kw)

    @property
    def tool_state(self) -> ToolState | None:
        """The session's tools and calls (None where this LLM cannot call tools)."""
        return self.tool_chat.state if self.tool_chat.supported else None

    def _emit_tool(self, ev: Any) -> None:
        self._emit(ev)

    def counters(self) -> dict[str, int]:
        out = PipelineBackend.counters(self)
        out["tool_calls"] = self.tool_chat.calls_made
        return out


def tool_pipeline_factory(**load_kw: Any) -> BackendFamily:
    """`pipeline_factory` with a `ToolChat` per session (the same shared models)."""
    from tristream.pipeline.models import load_models
    from tristream.serve.pipeline_metrics import pipeline_families

    models = load_models(**load_kw)
    return BackendFamily(lambda: ToolPipelineBackend(models), collect=lambda: pipeline_families(models.asr),
                         healthy=lambda: bool(getattr(models.llm, "healthy", True)), chat_llm=models.llm)


def tools_json(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    return [t.to_json() for t in tools]


__all__ = ["FunctionCallDelta", "FunctionCallDone", "ToolChat", "ToolPipelineBackend", "ToolState",
           "tool_pipeline_factory"]
