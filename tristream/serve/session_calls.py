"""Function calls in a `RealtimeSession`: checks of tools, choices and call items, and a response's call items.

The session keeps its tools in `SessionSettings` and hands them to the backend's
`tool_session.ToolState`; these functions validate what a client sends (the errors are
`ProtocolError`s with the ``param`` that is wrong) and `ResponseCalls` turns a backend's
`FunctionCallDelta` / `FunctionCallDone` events into the Realtime API's ``function_call``
output items of one response (announced on first sight, streamed, finished; cut off as
``incomplete`` when the response ends first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tristream.serve import protocol as P
from tristream.serve.tools import FunctionCallDelta, FunctionCallDone, ToolSpecError, parse_tool_choice

Send = Callable[[dict[str, Any]], None]


def tool_choice(raw: Any, tools: list[Any], param: str, eid: str | None) -> str:
    """A client's ``tool_choice`` checked against `tools`."""
    try:
        return parse_tool_choice(raw, tools, param)
    except ToolSpecError as e:
        raise P.ProtocolError(P.E_INVALID_VALUE, str(e), e.param, eid) from None


def check_tool_changes(changes: dict[str, Any], current_tools: list[Any], current_choice: str, tool_state: Any,
                       eid: str | None) -> None:
    """Validate ``tools`` / ``tool_choice`` of a session.update together, before anything changes; a named or
    required choice whose tools are gone falls back to ``auto`` (in `changes`)."""
    if "tools" not in changes and "tool_choice" not in changes:
        return
    tools = changes.get("tools", current_tools)
    if tools and tool_state is None:
        raise P.ProtocolError(P.E_INVALID_VALUE, "this server's backend cannot call tools (function calling "
                              "runs on the assistant backend over our engine)", "session.tools", eid)
    if "tool_choice" in changes:
        changes["tool_choice"] = tool_choice(changes["tool_choice"], tools, "session.tool_choice", eid)
    elif current_choice not in ("auto", "none", "required") and not any(t.name == current_choice for t in tools):
        changes["tool_choice"] = "auto"  # the named tool is gone
    elif current_choice == "required" and not tools:
        changes["tool_choice"] = "auto"


def function_item(ev: P.FunctionOutputCreate | P.FunctionCallCreate, tool_state: Any, item_id: str) -> dict[str, Any]:
    """Add a client's ``function_call_output`` / ``function_call`` to the conversation; its item JSON."""
    if tool_state is None:
        raise P.ProtocolError(P.E_INVALID_VALUE, "this server's backend cannot call tools, so it takes no "
                              "function_call items", "item.type", ev.event_id)
    try:
        if isinstance(ev, P.FunctionOutputCreate):
            tool_state.add_output(ev.call_id, ev.output)
            return {"id": item_id, "object": "realtime.item", "type": "function_call_output",
                    "call_id": ev.call_id, "output": ev.output, "status": "completed"}
        tool_state.add_call(ev.call_id, ev.name, ev.arguments)
        return {"id": item_id, "object": "realtime.item", "type": "function_call", "call_id": ev.call_id,
                "name": ev.name, "arguments": ev.arguments, "status": "completed"}
    except ToolSpecError as e:
        raise P.ProtocolError(P.E_INVALID_VALUE, str(e), e.param, ev.event_id) from None


@dataclasses.dataclass(slots=True)
class _CallItem:
    index: int
    item_id: str
    name: str
    args: list[str] = dataclasses.field(default_factory=list)
    done: bool = False


@dataclasses.dataclass(slots=True)
class ResponseCalls:
    """The function_call output items of one response."""

    response_id: str
    send: Send
    next_index: Callable[[], int]
    """Allocates the next output_index of the response (shared with its message item)."""
    items: dict[str, _CallItem] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.items)

    def _item(self, call_id: str, name: str) -> _CallItem:
        it = self.items.get(call_id)
        if it is None:
            it = self.items[call_id] = _CallItem(self.next_index(), P.new_id("item"), name)
            self.send(P.server_event("response.output_item.added", response_id=self.response_id,
                                     output_index=it.index, item=self._json(call_id, it, "in_progress", "")))
        return it

    @staticmethod
    def _json(call_id: str, it: _CallItem, status: str, arguments: str) -> dict[str, Any]:
        return {"id": it.item_id, "object": "realtime.item", "type": "function_call", "status": status,
                "name": it.name, "call_id": call_id, "arguments": arguments}

    def delta(self, ev: FunctionCallDelta) -> None:
        """Part of a call's arguments."""
        if not ev.delta:
            return
        it = self._item(ev.call_id, ev.name)
        it.args.append(ev.delta)
        self.send(P.server_event("response.function_call_arguments.delta", response_id=self.response_id,
                                 item_id=it.item_id, output_index=it.index, call_id=ev.call_id, delta=ev.delta))

    def done(self, ev: FunctionCallDone) -> dict[str, Any]:
        """A finished call: its events; returns its item (``incomplete`` when it hit the token limit)."""
        it = self._item(ev.call_id, ev.name)
        it.done = True
        self.send(P.server_event("response.function_call_arguments.done", response_id=self.response_id,
                                 item_id=it.item_id, output_index=it.index, call_id=ev.call_id, name=ev.name,
                                 arguments=ev.arguments))
        item = self._json(ev.call_id, it, "completed" if ev.complete else "incomplete", ev.arguments)
        self.send(P.server_event("response.output_item.done", response_id=self.response_id, output_index=it.index,
                                 item=item))
        return item

    def cut_off(self) -> list[dict[str, Any]]:
        """Calls the response ended before they finished (cancel, failure): ``incomplete`` with their
        arguments so far."""
        out = []
        for call_id, it in self.items.items():
            if not it.done:
                item = self._json(call_id, it, "incomplete", "".join(it.args))
                self.send(P.server_event("response.output_item.done", response_id=self.response_id,
                                         output_index=it.index, item=item))
                out.append(item)
        return out
