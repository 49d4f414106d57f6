"""OpenAI-compatible ``POST /v1/chat/completions`` (streaming SSE and not, with tools) on our engine.

The side HTTP port also carries other POST routes given by the server (the WebRTC SDP offer).

`tristream serve` opens it on its own port (``--chat-port``, default PORT+1): the WebSocket
library that serves the realtime port reads no request bodies. The same bearer tokens as the
realtime routes; ``GET /v1/models`` lists the model. HTTP/1.1 with ``Connection: close``,
plain asyncio streams. Requests go through `ToolCaller` on the assistant's engine (the same
`EngineChatBackend` its sessions use, so they batch with them): ``tools`` / ``tool_choice`` as
in OpenAI's API (a named or required function is decoded under its schema's mask), assistant
``tool_calls`` and ``tool`` messages in the history. Sampling: ``max_tokens`` /
``max_completion_tokens`` (default 256), ``temperature``, ``top_p``, ``seed``, ``stop``;
``n`` must be 1. A malformed request gets HTTP 400 with an OpenAI-style error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tristream.serve.tool_session import ToolState, render_format
from tristream.serve.tools import (
    FunctionCallDelta,
    FunctionCallDone,
    TextPiece,
    ToolCaller,
    ToolSpecError,
    parse_tool_choice,
    parse_tools,
)

MAX_BODY = 4 << 20
CORS = "Access-Control-Allow-Origin: *\r\n"
"""Any origin may call (the bearer token is the credential; no cookies are read)."""
Route = Callable[[dict[str, str], bytes], Awaitable[tuple[int, str, bytes]]]
"""A POST route of the side port: (lower-case headers, body) -> (status, content type, body)."""
DEFAULT_MAX_TOKENS = 256


class BadRequest(Exception):
    """A request this endpoint refuses (HTTP 400 unless ``status`` says otherwise)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def _text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise BadRequest(f"{param}[{i}] must be a text part ({{'type': 'text', 'text': ...}}); "
                                 "images are not supported here", f"{param}[{i}]")
            parts.append(p["text"])
        return "".join(parts)
    raise BadRequest(f"{param} must be a string or a list of text parts", param)


def conversation(raw: Any, fmt: str) -> list[dict[str, str]]:
    """OpenAI chat messages as template messages (calls and tool outputs rendered for `fmt`)."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    msgs: list[dict[str, str]] = []
    state = ToolState()
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{p} must be an object", p)
        role = m.get("role")
        if role in ("system", "developer", "user"):
            text = _text(m.get("content"), f"{p}.content")
            msgs.append({"role": "system" if role != "user" else "user", "content": text})
            if role == "user":
                state.last_user = text
        elif role == "assistant":
            text = _text(m.get("content"), f"{p}.content")
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise BadRequest(f"{p}.tool_calls must be a list", f"{p}.tool_calls")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(c.get("id"), str) or not isinstance(fn.get("name"), str):
                    raise BadRequest(f"{p}.tool_calls[{j}] needs an id and a function with a name",
                                     f"{p}.tool_calls[{j}]")
                args = fn.get("arguments", "{}")
                try:
                    if not isinstance(json.loads(args), dict):
                        raise ValueError
                except (TypeError, ValueError):
                    raise BadRequest(f"{p}.tool_calls[{j}].function.arguments must be a JSON object in a string",
                                     f"{p}.tool_calls[{j}].function.arguments") from None
                try:
                    state.add_call(c["id"], fn["name"], args)
                except ToolSpecError as e:
                    raise BadRequest(str(e), f"{p}.tool_calls[{j}].id") from None
            if text:
                msgs.append({"role": "assistant", "content": text})
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str):
                raise BadRequest(f"{p}.tool_call_id is required for a tool message", f"{p}.tool_call_id")
            try:
                state.add_output(cid, _text(m.get("content"), f"{p}.content"))
            except ToolSpecError as e:
                raise BadRequest(str(e), f"{p}.tool_call_id") from None
        else:
            raise BadRequest(f"{p}.role must be system, developer, user, assistant or tool; got {role!r}",
                             f"{p}.role")
    return state.conversation(msgs, fmt)


def _sampling(body: dict[str, Any]) -> Any:
    from tristream.engine.sequence import SamplingParams

    n = body.get("n", 1)
    if n != 1:
        raise BadRequest("only n=1 is supported", "n")
    mt = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if not isinstance(mt, int) or isinstance(mt, bool) or not 1 <= mt <= 4096:
        raise BadRequest("max_tokens must be an integer in 1..4096", "max_tokens")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    try:
        return SamplingParams(max_tokens=mt, temperature=float(body.get("temperature", 1.0) or 0.0),
                              top_p=float(body.get("top_p", 1.0)), seed=body.get("seed"), stop=tuple(stop))
    except (TypeError, ValueError) as e:
        raise BadRequest(f"bad sampling parameters: {e}", "temperature") from None


class ChatCompletionsServer:
    """Serves ``/v1/chat/completions`` and ``/v1/models`` for one `EngineChatBackend`."""

    def __init__(self, chat: Any, authorized: Callable[[str | None], bool], host: str = "127.0.0.1",
                 port: int = 0, model_name: str = "tristream-embedded", draining: Callable[[], bool] = lambda: False,
                 count: Callable[..., None] | None = None, routes: dict[str, Route] | None = None) -> None:
        """``chat``: an `EngineChatBackend` (None: no chat route, only ``routes``); ``routes``: other
        POST routes of this port by path (the WebRTC SDP exchange)."""
        self.caller = ToolCaller(chat) if chat is not None else None
        self.fmt = render_format(self.caller) if self.caller is not None else ""
        self.routes = dict(routes or {})
        self.authorized = authorized
        self.host, self.port = host, port
        self.model_name = model_name
        self.draining = draining
        self.count = count or (lambda *a, **k: None)
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, path = (lines[0].split(" ") + ["", ""])[:2]
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            path = path.split("?", 1)[0]
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
            try:
                known = (["/v1/chat/completions", "/v1/models"] if self.caller is not None else []) + list(self.routes)
                if method == "OPTIONS" and path in known:  # a browser's CORS preflight (the page is on the realtime port)
                    writer.write(f"HTTP/1.1 204 No Content\r\n{CORS}Access-Control-Allow-Methods: GET, POST, "
                                 "OPTIONS\r\nAccess-Control-Allow-Headers: Authorization, Content-Type\r\n"
                                 "Access-Control-Max-Age: 600\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                                 .encode())
                    await writer.drain()
                    return
                if path not in known:
                    raise BadRequest(f"no route {path}; this port serves {', '.join(known)}",
                                     status=404, code="not_found")
                if not self.authorized(token):
                    raise BadRequest("missing or invalid bearer token: send 'Authorization: Bearer <token>'",
                                     status=401, code="invalid_api_key")
                if self.draining():
                    raise BadRequest("server is shutting down", status=503, code="server_shutting_down")
                if path in self.routes:
                    if method != "POST":
                        raise BadRequest(f"use POST for {path}", status=405)
                    n = int(headers.get("content-length", "0") or 0)
                    if n > MAX_BODY:
                        raise BadRequest(f"body of {n} bytes is over the {MAX_BODY}-byte limit", status=413)
                    raw = await asyncio.wait_for(reader.readexactly(n), 30) if n else b""
                    status, ctype, data = await self.routes[path](headers, raw)
                    writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: {ctype}\r\n"
                                 f"Content-Length: {len(data)}\r\nConnection: close\r\n{CORS}\r\n".encode() + data)
                    await writer.drain()
                    return
                if path == "/v1/models":
                    await self._json(writer, 200, {"object": "list", "data": [
                        {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tristream"}]})
                    return
                if method != "POST":
                    raise BadRequest("use POST for /v1/chat/completions", status=405)
                n = int(headers.get("content-length", "0") or 0)
                if n > MAX_BODY:
                    raise BadRequest(f"body of {n} bytes is over the {MAX_BODY}-byte limit", status=413)
                raw = await asyncio.wait_for(reader.readexactly(n), 30) if n else b""
                try:
                    body = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise BadRequest(f"the body is not valid JSON: {e}", code="invalid_json") from None
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                await self._complete(body, writer)
            except BadRequest as e:
                self.count("tristream_chat_requests_total", status=str(e.status))
                await self._json(writer, e.status, {"error": {
                    "message": e.message, "type": "invalid_request_error" if e.status < 500 else "server_error",
                    "param": e.param, "code": e.code}})
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _json(self, writer: asyncio.StreamWriter, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n{CORS}\r\n".encode() + data)
        await writer.drain()

    async def _complete(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        assert self.caller is not None
        try:
            tools = parse_tools(body.get("tools") or [], "tools")
            choice = parse_tool_choice(body.get("tool_choice"), tools, "tool_choice")
        except ToolSpecError as e:
            raise BadRequest(str(e), e.param) from None
        msgs = conversation(body.get("messages"), self.fmt)
        params = _sampling(body)
        stream = bool(body.get("stream", False))
        cid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        base = {"id": cid, "created": created, "model": body.get("model") or self.model_name}
        pieces = self.caller.run(msgs, tools, choice, params.max_tokens, params=params)
        self.count("tristream_chat_requests_total", status="200")
        if not stream:
            text: list[str] = []
            calls: list[dict[str, Any]] = []
            async for p in pieces:
                if isinstance(p, TextPiece):
                    text.append(p.text)
                elif isinstance(p, FunctionCallDone):
                    calls.append({"id": p.call_id, "type": "function",
                                  "function": {"name": p.name, "arguments": p.arguments}})
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            await self._json(writer, 200, {**base, "object": "chat.completion", "choices": [
                {"index": 0, "message": msg, "finish_reason": "tool_calls" if calls else "stop"}], "usage": None})
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
                     b"Connection: close\r\n" + CORS.encode() + b"\r\n")

        async def chunk(delta: dict[str, Any], finish: str | None = None) -> None:
            ev = {**base, "object": "chat.completion.chunk",
                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            writer.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            await writer.drain()

        await chunk({"role": "assistant", "content": ""})
        seen: dict[str, int] = {}
        try:
            async with contextlib.aclosing(pieces) as gen:
                async for p in gen:
                    if isinstance(p, TextPiece):
                        await chunk({"content": p.text})
                    elif isinstance(p, (FunctionCallDelta, FunctionCallDone)):
                        if p.call_id not in seen:
                            seen[p.call_id] = len(seen)
                            await chunk({"tool_calls": [{"index": seen[p.call_id], "id": p.call_id, "type": "function",
                                                         "function": {"name": p.name, "arguments": ""}}]})
                        if isinstance(p, FunctionCallDelta) and p.delta:
                            await chunk({"tool_calls": [{"index": seen[p.call_id],
                                                         "function": {"arguments": p.delta}}]})
            await chunk({}, "tool_calls" if seen else "stop")
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        except ConnectionError:  # the client left: closing the generator cancelled the sequence
            self.count("tristream_chat_requests_total", status="client_closed")


_REASONS = {200: "OK", 201: "Created", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            413: "Payload Too Large", 503: "Service Unavailable"}

__all__ = ["BadRequest", "ChatCompletionsServer", "conversation"]
