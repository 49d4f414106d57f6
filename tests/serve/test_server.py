"""The real server on loopback (real sockets): auth, limits, bad input, isolation, shutdown."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import urllib.error
import urllib.request

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.serve.helpers import TOKEN, run, running_server, serving, tone_turns, url
from tristream.serve import protocol as P
from tristream.serve.client import RealtimeClient, stream_media
from tristream.serve.echo import EchoBackend
from tristream.serve.limits import ServerLimits

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def next_of(ws: object, etype: str, limit: int = 200) -> dict:
    """Read events until one of type ``etype``."""
    for _ in range(limit):
        ev = json.loads(await asyncio.wait_for(ws.recv(), 10))  # type: ignore[attr-defined]
        if ev["type"] == etype:
            return ev
    raise AssertionError(f"no {etype} in {limit} events")


def test_auth_required() -> None:
    async def go() -> None:
        async with running_server() as srv:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                with pytest.raises(InvalidStatus) as ei:
                    async with connect(url(srv), additional_headers=headers):
                        pass
                assert ei.value.response.status_code == 401
            async with connect(url(srv), additional_headers=AUTH) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
            # Browser style: the token as a subprotocol.
            async with connect(url(srv), subprotocols=["realtime", f"openai-insecure-api-key.{TOKEN}"]) as ws:
                assert ws.subprotocol == "realtime"
                assert json.loads(await ws.recv())["type"] == "session.created"
            assert srv.metrics.count("tristream_connections_refused_total", reason="auth") == 3
    run(go())


def test_http_routes() -> None:
    async def go() -> None:
        async with running_server() as srv:
            base = f"http://127.0.0.1:{srv.port}"

            def get(path: str) -> tuple[int, str]:
                try:
                    with urllib.request.urlopen(base + path, timeout=5) as r:
                        return r.status, r.read().decode()
                except urllib.error.HTTPError as e:
                    return e.code, e.read().decode()

            loop = asyncio.get_running_loop()
            assert (await loop.run_in_executor(None, get, "/healthz"))[0] == 200
            assert (await loop.run_in_executor(None, get, "/readyz"))[0] == 200
            status, body = await loop.run_in_executor(None, get, "/metrics")
            assert status == 200 and "tristream_sessions_active 0" in body
            status, body = await loop.run_in_executor(None, get, "/")
            assert status == 200 and "<html" in body.lower()
            assert (await loop.run_in_executor(None, get, "/nope"))[0] == 404
    run(go())


def test_bad_messages_get_errors_and_session_survives() -> None:
    limits = ServerLimits(max_message_bytes=64 * 1024)

    async def go() -> None:
        async with running_server(limits=limits) as srv:
            async with connect(url(srv), additional_headers=AUTH, max_size=None) as ws:
                await next_of(ws, "session.created")
                cases = [
                    ("{oops", P.E_INVALID_JSON),
                    (json.dumps({"type": "response.cancel"}), P.E_NO_ACTIVE_RESPONSE),  # out of order
                    (json.dumps({"type": "input_audio_buffer.commit", "event_id": "c1"}), P.E_EMPTY_BUFFER),
                    (json.dumps({"type": "no.such.event"}), P.E_UNKNOWN_EVENT),
                    (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 100_000}), P.E_TOO_LARGE),
                    (json.dumps({"type": "session.update", "session": {"turn_detection": {"threshold": 7}}}),
                     P.E_INVALID_VALUE),
                    (b"\x00binary", P.E_INVALID_EVENT),
                ]
                for raw, code in cases:
                    await ws.send(raw)
                    err = await next_of(ws, "error")
                    assert err["error"]["code"] == code, (raw[:60], err)
                assert err["error"]["message"]
                # Still alive: a text turn works end to end.
                await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                    "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello there"}]}}))
                await next_of(ws, "conversation.item.created")
                await ws.send(json.dumps({"type": "response.create"}))
                # A second response.create while one runs is out of order.
                await ws.send(json.dumps({"type": "response.create", "event_id": "dup"}))
                seen: list[dict] = []
                while not seen or seen[-1]["type"] != "response.done":
                    seen.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
                errs = [e for e in seen if e["type"] == "error"]
                assert [e["error"]["code"] for e in errs] == [P.E_RESPONSE_ACTIVE]
                assert errs[0]["error"]["event_id"] == "dup"
                text = "".join(e["delta"] for e in seen if e["type"] == "response.audio_transcript.delta")
                assert text == "echo: hello there"
                assert seen[-1]["response"]["status"] == "completed"
            assert srv.metrics.count("tristream_client_errors_total", code=P.E_TOO_LARGE) == 1
    run(go())


def test_rate_limit_drops_are_counted() -> None:
    limits = ServerLimits(max_messages_per_s=5, burst_messages=5)

    async def go() -> None:
        async with running_server(limits=limits) as srv:
            async with connect(url(srv), additional_headers=AUTH) as ws:
                await next_of(ws, "session.created")
                for _ in range(20):
                    await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
                codes = []
                for _ in range(20):
                    ev = json.loads(await asyncio.wait_for(ws.recv(), 10))
                    codes.append(ev["error"]["code"] if ev["type"] == "error" else ev["type"])
                assert codes.count("input_audio_buffer.cleared") >= 5
                assert codes.count(P.E_RATE_LIMITED) >= 10
            assert srv.metrics.count("tristream_messages_dropped_total", reason="rate_limited") == \
                codes.count(P.E_RATE_LIMITED)
    run(go())


def _jpeg() -> bytes:
    return b"\xff\xd8\xff\xe0" + bytes(200) + b"\xff\xd9"


def test_twenty_concurrent_clients_audio_and_video() -> None:
    """20 clients stream distinct turns plus frames at once; each gets exactly its own transcripts."""
    n = 20

    async def one(srv: object, i: int) -> tuple[int, list]:
        durs = [200 + 20 * i, 600 + 20 * i]
        frames = [(k * 0.2, _jpeg()) for k in range(10)]
        res = await stream_media(url(srv), TOKEN, tone_turns(durs), 24_000, frames=frames, pace=0,
                                 expect_turns=2, session={"turn_detection": {"interrupt_response": False}})
        return i, res

    async def go() -> None:
        async with running_server(limits=ServerLimits(max_sessions=n)) as srv:
            out = await asyncio.gather(*(one(srv, i) for i in range(n)))
            for i, res in out:
                assert [r.transcript for r in res] == [f"speech {200 + 20 * i} ms", f"speech {600 + 20 * i} ms"]
                assert all(r.status == "completed" for r in res)
                assert res[1].answer.startswith(f"echo: speech {600 + 20 * i} ms")
                assert sum(int(r.answer.split("(")[1].split()[0]) for r in res if "(" in r.answer) <= 10
                assert res[1].audio_samples > 0
            assert srv.metrics.count("tristream_sessions_total") == n
    run(go(), timeout=60)


def test_max_sessions() -> None:
    async def go() -> None:
        async with running_server(limits=ServerLimits(max_sessions=2)) as srv:
            a = await RealtimeClient.connect(url(srv), TOKEN)
            b = await RealtimeClient.connect(url(srv), TOKEN)
            with pytest.raises(InvalidStatus) as ei:
                async with connect(url(srv), additional_headers=AUTH):
                    pass
            assert ei.value.response.status_code == 503
            await a.close()
            await b.close()
    run(go())


def test_session_length_limit() -> None:
    async def go() -> None:
        async with running_server(limits=ServerLimits(max_session_s=0.3)) as srv:
            async with connect(url(srv), additional_headers=AUTH) as ws:
                await next_of(ws, "session.created")
                err = await next_of(ws, "error")
                assert err["error"]["code"] == P.E_SESSION_EXPIRED
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 5)
    run(go())


def test_slow_client_does_not_stall_others() -> None:
    """A client that never reads is cut off; a normal client on the same server keeps working."""
    limits = ServerLimits(write_buffer_bytes=32 * 1024, send_timeout_s=0.5, max_outbox_events=256,
                          max_bytes_per_s=64 << 20, burst_bytes=64 << 20, max_messages_per_s=10_000,
                          burst_messages=10_000)

    async def go() -> None:
        async with running_server(limits=limits) as srv:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", srv.port))
            bad = await connect(url(srv), additional_headers=AUTH, sock=sock, max_size=None)
            await bad.send(json.dumps({"type": "session.update", "session": {
                "output_audio_sample_rate": 48_000, "turn_detection": {"interrupt_response": False}}}))
            turn = tone_turns([3000], gap_ms=600)
            chunks = [base64.b64encode(turn[k:k + 24_000].tobytes()).decode() for k in range(0, turn.size, 24_000)]
            closed = False
            for _ in range(80):  # bounded: ~80 * 3 s of echoed 48 kHz audio at most
                try:
                    for c in chunks:
                        await bad.send(json.dumps({"type": "input_audio_buffer.append", "audio": c}))
                    await asyncio.sleep(0.01)
                except ConnectionClosed:
                    closed = True
                    break
                # Meanwhile a well-behaved client gets its answer.
                if _ % 20 == 0:
                    res = await stream_media(url(srv), TOKEN, tone_turns([300]), 24_000, pace=0, expect_turns=1,
                                             answer_timeout_s=5)
                    assert [r.transcript for r in res] == ["speech 300 ms"]
                if srv.metrics.count("tristream_sessions_closed_total", reason="send_timeout") + \
                        srv.metrics.count("tristream_sessions_closed_total", reason="slow_client"):
                    closed = True
                    break
            assert closed, "the non-reading client was never cut off"
            bad.transport.abort()
    run(go(), timeout=60)


def test_graceful_shutdown_lets_answer_finish() -> None:
    async def go() -> None:
        from tristream.serve.echo import EchoBackend
        from tristream.serve.server import RealtimeServer

        srv = RealtimeServer(lambda: EchoBackend(pace=1.0), port=0, tokens=[TOKEN])
        await srv.start()
        ws = await connect(url(srv), additional_headers=AUTH)
        await next_of(ws, "session.created")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "a b c d e"}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        await next_of(ws, "response.created")
        stopper = asyncio.get_running_loop().create_task(srv.stop(grace_s=5.0))
        seen = []
        with pytest.raises(ConnectionClosed) as ei:
            while True:
                seen.append(json.loads(await asyncio.wait_for(ws.recv(), 10))["type"])
        await stopper
        assert "error" in seen and seen.index("error") < seen.index("response.done")
        assert ei.value.rcvd is not None and ei.value.rcvd.code == 1001
        with pytest.raises((OSError, InvalidStatus)):
            await connect(url(srv), additional_headers=AUTH, open_timeout=2)
    run(go())


def test_manual_commit_without_vad() -> None:
    async def go() -> None:
        async with running_server() as srv:
            c = await RealtimeClient.connect(url(srv), TOKEN)
            await c.send({"type": "session.update", "session": {"turn_detection": None,
                                                                "input_audio_sample_rate": 16_000}})
            await c.append_audio(tone_turns([500], rate=16_000, gap_ms=100))
            await c.send({"type": "input_audio_buffer.commit"})
            types, transcript = [], ""
            while "response.done" not in types:
                ev = await c.recv(10)
                types.append(ev["type"])
                if ev["type"].endswith("transcription.completed"):
                    transcript = ev["transcript"]
            assert "input_audio_buffer.speech_started" not in types
            assert "input_audio_buffer.committed" in types
            assert transcript == "speech 500 ms"
            await c.close()
    run(go())


def test_output_audio_is_the_echoed_turn() -> None:
    """The echo answer's audio is the user's own turn, resampled: checks the audio path end to end."""
    async def go() -> None:
        async with running_server() as srv:
            c = await RealtimeClient.connect(url(srv), TOKEN)
            await c.send({"type": "session.update", "session": {"input_audio_sample_rate": 16_000,
                                                                "output_audio_sample_rate": 16_000}})
            pcm = tone_turns([400], rate=16_000)
            await c.append_audio(pcm)
            got = []
            while True:
                ev = await c.recv(10)
                if ev["type"] == "response.audio.delta":
                    got.append(np.frombuffer(base64.b64decode(ev["delta"]), "<i2"))
                if ev["type"] == "response.done":
                    break
            out = np.concatenate(got)
            voiced = pcm[np.abs(pcm) > 0]
            assert out.size >= 400 * 16 and np.abs(out).max() == np.abs(voiced).max()
            await c.close()
    run(go())


def test_metrics_can_require_the_token(capsys: pytest.CaptureFixture[str]) -> None:
    """``--metrics-auth``: /metrics answers 401 without the bearer token and 200 with it, and
    `tristream top` says in one line that it needs ``--token`` (then shows the server with it)."""
    from tristream.cli import app
    from tristream.commands.errors import run as cli

    async def go() -> None:
        async with serving(EchoBackend, metrics_auth=True) as srv:
            base = f"http://127.0.0.1:{srv.port}/metrics"

            def get(headers: dict[str, str]) -> int:
                try:
                    with urllib.request.urlopen(urllib.request.Request(base, headers=headers), timeout=5) as r:
                        return int(r.status)
                except urllib.error.HTTPError as e:
                    return int(e.code)

            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, get, {}) == 401
            assert await loop.run_in_executor(None, get, {"Authorization": "Bearer wrong"}) == 401
            assert await loop.run_in_executor(None, get, dict(AUTH)) == 200
            assert srv.metrics.count("tristream_connections_refused_total", reason="auth") == 2
            rc = await loop.run_in_executor(None, cli, app, ["top", "--once", "--url", base])
            err = capsys.readouterr().err.strip()
            assert rc == 2 and err.startswith("error: ") and "--token" in err and "\n" not in err, err
            rc = await loop.run_in_executor(None, cli, app, ["top", "--once", "--url", base, "--token", TOKEN])
            assert rc == 0 and "sessions" in capsys.readouterr().out
    run(go())
