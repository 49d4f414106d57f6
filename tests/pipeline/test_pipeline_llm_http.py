"""OpenAI-compatible streaming: our client against our server and against a hand-written SSE server.

Both over real loopback sockets; the backend behind our server is scripted so the test is
fast and deterministic (the engine behind it is exercised by the session tests).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from tests.pipeline.openai_server import OpenAICompatServer
from tristream.pipeline.llm import LlmEndpointError, OpenAIChatBackend


class ScriptedBackend:
    """Streams the words of a fixed answer, one await per word; records cancellation."""

    name = "scripted"

    def __init__(self, words: list[str], gate: asyncio.Event | None = None) -> None:
        self.words = words
        self.gate = gate
        self.seen: list[list[dict[str, str]]] = []
        self.closed_early = 0

    async def stream(self, messages: list[dict[str, str]], max_tokens: int) -> AsyncIterator[str]:
        self.seen.append(messages)
        done = False
        try:
            for i, w in enumerate(self.words[:max_tokens]):
                if self.gate is not None and i == 2:
                    await self.gate.wait()
                await asyncio.sleep(0)
                yield w
            done = True
        finally:
            if not done:
                self.closed_early += 1


def test_client_streams_deltas_from_our_server() -> None:
    async def main() -> tuple[list[str], ScriptedBackend]:
        backend = ScriptedBackend(["The ", "capital ", "is ", "Paris."])
        server = OpenAICompatServer(backend)
        await server.start()
        client = OpenAIChatBackend(server.url)
        try:
            deltas = [d async for d in client.stream([{"role": "user", "content": "capital?"}], 16)]
        finally:
            await client.aclose()
            await server.close()
        return deltas, backend

    deltas, backend = asyncio.run(main())
    assert deltas == ["The ", "capital ", "is ", "Paris."]
    assert backend.seen == [[{"role": "user", "content": "capital?"}]]


def test_closing_the_client_stream_cancels_the_generation_on_the_server() -> None:
    async def main() -> tuple[list[str], int]:
        gate = asyncio.Event()
        backend = ScriptedBackend(["a ", "b ", "c ", "d "], gate=gate)
        server = OpenAICompatServer(backend)
        await server.start()
        client = OpenAIChatBackend(server.url)
        got: list[str] = []
        gen = client.stream([{"role": "user", "content": "x"}], 16)
        async for d in gen:
            got.append(d)
            if len(got) == 2:
                break
        await gen.aclose()  # type: ignore[attr-defined]  # barge-in: the LLM stage closes its stream
        gate.set()
        for _ in range(200):
            if backend.closed_early:
                break
            await asyncio.sleep(0.01)
        await client.aclose()
        await server.close()
        return got, backend.closed_early

    got, closed = asyncio.run(main())
    assert got == ["a ", "b "]
    assert closed == 1


def test_client_against_a_hand_written_sse_server() -> None:
    """Independent of our server: raw SSE with comments, blank lines and a role-only first chunk."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        n = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
        body = json.loads(await reader.readexactly(n))
        assert body["stream"] is True and body["max_tokens"] == 7
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        events = [{"choices": [{"delta": {"role": "assistant"}}]},
                  {"choices": [{"delta": {"content": "Hel"}}]},
                  {"choices": [{"delta": {"content": "lo!"}}]}]
        writer.write(b": keep-alive\n\n")
        for e in events:
            writer.write(b"data: " + json.dumps(e).encode() + b"\n\n")
            await writer.drain()
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()

    async def main() -> list[str]:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        client = OpenAIChatBackend(f"http://127.0.0.1:{port}/v1/")
        try:
            return [d async for d in client.stream([{"role": "user", "content": "hi"}], 7)]
        finally:
            await client.aclose()
            srv.close()
            await srv.wait_closed()

    assert asyncio.run(main()) == ["Hel", "lo!"]


async def _ask(url: str) -> None:
    """One streamed answer from `url`, read to its end."""
    client = OpenAIChatBackend(url)
    try:
        async for _ in client.stream([{"role": "user", "content": "x"}], 4):
            pass
    finally:
        await client.aclose()


def test_endpoint_errors_are_actionable() -> None:
    async def refused() -> None:
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        await _ask(f"http://127.0.0.1:{port}/v1")

    with pytest.raises(LlmEndpointError, match="cannot reach the LLM endpoint"):
        asyncio.run(refused())

    async def not_found() -> None:
        server = OpenAICompatServer(ScriptedBackend(["x"]))
        await server.start()
        try:
            await _ask(f"http://127.0.0.1:{server.port}/nope")
        finally:
            await server.close()

    with pytest.raises(LlmEndpointError, match="HTTP 404"):
        asyncio.run(not_found())
