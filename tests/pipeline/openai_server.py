"""Test fixture: a minimal OpenAI-compatible streaming chat endpoint in front of any `ChatBackend`
(the product's own endpoint is `serve/chat_completions.py`; this one serves a scripted backend
to `OpenAIChatBackend` over real sockets).

`POST /v1/chat/completions` with `"stream": true` answers server-sent events in the
OpenAI chunk format and ends with `data: [DONE]`; `"stream": false` answers one JSON
completion. Plain asyncio streams, HTTP/1.1 with `Connection: close`: enough for our
`OpenAIChatBackend`, curl and the `openai` client, and for testing them over real sockets.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from tristream.pipeline.llm import ChatBackend

_MAX_BODY = 1 << 20


class OpenAICompatServer:
    """Serves `backend` at `http://host:port/v1/chat/completions`."""

    def __init__(self, backend: ChatBackend, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "tristream") -> None:
        self.backend = backend
        self.host = host
        self.port = port
        self.model_name = model_name
        self.requests = 0
        self.errors = 0
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        """The API base to give clients (`--llm-url`)."""
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> None:
        """Listen; with port 0 the OS picks a free port (see `url`)."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and wait for the server to close."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = (lines[0].split(" ", 2) + ["", ""])[:3]
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            n = int(headers.get("content-length", "0"))
            if n > _MAX_BODY:
                await self._reply(writer, 413, {"error": {"message": f"body of {n} bytes is over {_MAX_BODY}"}})
                return
            body = await reader.readexactly(n) if n else b""
            if method != "POST" or path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                await self._reply(writer, 404, {"error": {"message": f"no route {method} {path}"}})
                return
            try:
                req = json.loads(body or b"{}")
                messages = req["messages"]
            except (ValueError, KeyError) as e:
                await self._reply(writer, 400, {"error": {"message": f"bad request body: {e}"}})
                return
            self.requests += 1
            max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 128)
            if req.get("stream"):
                await self._stream(writer, messages, max_tokens)
            else:
                text = "".join([d async for d in self.backend.stream(messages, max_tokens)])
                await self._reply(writer, 200, self._completion(text))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.errors += 1
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, messages: list[dict[str, str]], max_tokens: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Connection: close\r\n\r\n")
        cid = f"chatcmpl-{time.monotonic_ns()}"
        gen = self.backend.stream(messages, max_tokens)
        try:
            async for delta in gen:
                chunk = {"id": cid, "object": "chat.completion.chunk", "model": self.model_name,
                         "choices": [{"index": 0, "delta": {"content": delta}, "finish_reason": None}]}
                writer.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await writer.drain()  # raises when the client hung up: the generation is cancelled
            end = {"id": cid, "object": "chat.completion.chunk", "model": self.model_name,
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            writer.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
            await writer.drain()
        finally:
            await gen.aclose()  # type: ignore[attr-defined]

    def _completion(self, text: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{time.monotonic_ns()}", "object": "chat.completion", "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop"}]}

    async def _reply(self, writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 413: "Payload Too Large"}.get(status, "Error")
        body = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
