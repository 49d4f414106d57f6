"""Issue 9 item 8 (fast form): auth before any model work, session isolation, unguessable ids,
owner-only recordings."""

from __future__ import annotations

import asyncio
import json
import re
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.reliability.live import connect_auth, text_turn
from tests.serve.helpers import TOKEN, run, url
from tristream.serve.echo import EchoBackend
from tristream.serve.server import RealtimeServer


def test_no_or_wrong_token_refused_before_any_backend_is_built(tmp_path: Path) -> None:
    built: list[int] = []

    def factory() -> EchoBackend:
        built.append(1)
        return EchoBackend()

    async def go() -> None:
        srv = RealtimeServer(factory, port=0, tokens=[TOKEN], record_dir=tmp_path)
        await srv.start()
        try:
            attempts = [{}, {"Authorization": "Bearer "}, {"Authorization": f"Bearer {TOKEN}x"},
                        {"Authorization": f"Bearer {TOKEN[:-1]}"}, {"Authorization": f"Basic {TOKEN}"},
                        {"Authorization": TOKEN}]
            for headers in attempts:
                with pytest.raises(InvalidStatus) as ei:
                    async with connect(url(srv), additional_headers=headers):
                        pass
                assert ei.value.response.status_code == 401
            for proto in ([f"openai-insecure-api-key.{TOKEN}x"], ["realtime"]):
                with pytest.raises(InvalidStatus):
                    async with connect(url(srv), subprotocols=proto):  # type: ignore[arg-type]
                        pass
            assert built == [] and srv.metrics.count("tristream_sessions_total") == 0
            assert list(tmp_path.iterdir()) == []  # nothing recorded for a refused client
            assert srv.metrics.count("tristream_connections_refused_total", reason="auth") == len(attempts) + 2
        finally:
            await srv.stop(grace_s=0.0)
    run(go())


def test_sessions_see_only_their_own_events_ids_unguessable_recordings_private(tmp_path: Path) -> None:
    rec = tmp_path / "rec"

    async def go() -> None:
        srv = RealtimeServer(lambda: EchoBackend(pace=0.05), port=0, tokens=[TOKEN], record_dir=rec)
        await srv.start()
        try:
            wss = [await connect_auth(url(srv), TOKEN) for _ in range(12)]
            outs = await asyncio.gather(*(text_turn(ws, f"secret-{i}-words") for i, ws in enumerate(wss)))
            for i, evs in enumerate(outs):
                blob = " ".join(body for _, body in evs)
                assert f"secret-{i}-" in blob
                others = set(re.findall(r"secret-(\d+)-", blob))
                assert others == {str(i)}, (i, others)  # never another session's text
            ids = list(srv.conns)
            assert len(set(ids)) == len(ids)
            assert all(re.fullmatch(r"sess_[0-9a-f]{32}", s) for s in ids)  # 128 random bits, not a counter
            port = srv.port

            def get(path: str) -> int:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                        return int(r.status)
                except urllib.error.HTTPError as e:
                    return int(e.code)

            loop = asyncio.get_running_loop()
            for path in (f"/{ids[0]}.mcap", f"/rec/{ids[0]}.mcap", "/../rec", f"/v1/realtime/{ids[0]}",
                         "/%2e%2e/etc/passwd"):
                assert await loop.run_in_executor(None, get, path) in (404, 400, 426), path
            for ws in wss:
                await ws.close()
        finally:
            await srv.stop(grace_s=0.0)
        assert stat.S_IMODE(rec.stat().st_mode) == 0o700
        files = list(rec.glob("*.mcap"))
        assert len(files) == 12
        for f in files:
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        # a recording holds only its own session's traffic
        for f in files:
            data = f.read_bytes()
            assert len(set(re.findall(rb"secret-(\d+)-", data))) == 1
    run(go())


def test_session_update_cannot_switch_session_identity() -> None:
    async def go() -> None:
        srv = RealtimeServer(lambda: EchoBackend(), port=0, tokens=[TOKEN])
        await srv.start()
        try:
            a = await connect_auth(url(srv), TOKEN)
            b = await connect_auth(url(srv), TOKEN)
            other = [s for s in srv.conns][0]
            await b.send(json.dumps({"type": "session.update", "session": {"id": other}}))
            ev = json.loads(await asyncio.wait_for(b.recv(), 5))
            assert ev["type"] == "error" and ev["error"]["code"] == "unknown_parameter"
            await a.close()
            await b.close()
        finally:
            await srv.stop(grace_s=0.0)
    run(go())
