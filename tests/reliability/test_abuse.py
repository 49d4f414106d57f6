"""Issue 9 item 7 (fast form): oversized messages, compression bombs, many idle connections, slow readers.

(10,000 idle connections and the other sessions' P99 next to a slow reader are in
`bench/reliability.py`; here a few hundred connections and correctness.)
"""

from __future__ import annotations

import pytest

from tests.reliability.abuse import compressed_frame, idle_connections, oversize, slow_reader
from tests.reliability.live import text_turn
from tests.serve.helpers import TOKEN, run, running_server, url
from tristream.serve.limits import ServerLimits

LIMIT = 1 << 20


def test_oversized_frame_closed_1009_fast_without_buffering_it() -> None:
    async def go() -> None:
        async with running_server(limits=ServerLimits(hard_message_bytes=LIMIT)) as srv:
            r = await oversize(url(srv), TOKEN, announce=64 * LIMIT, stream_bytes=8 * LIMIT)
            assert r["close_code"] == 1009
            assert r["seconds_to_close"] < 1.0
            assert r["rss_growth_mb"] * (1 << 20) < 2 * LIMIT
            r2 = await oversize(url(srv), TOKEN, announce=LIMIT + 1, stream_bytes=LIMIT + 1)
            assert r2["close_code"] == 1009
    run(go())


def test_compression_is_never_negotiated_and_compressed_frames_are_refused() -> None:
    async def go() -> None:
        async with running_server() as srv:
            r = await compressed_frame(url(srv), TOKEN)
            assert r["extension_negotiated"] is None
            assert r["close_code"] == 1002  # protocol error: RSV1 without an extension
            assert r["seconds_to_close"] < 1.0
    run(go())


def test_idle_connections_limit_enforced_with_a_clear_refusal() -> None:
    async def go() -> None:
        async with running_server(limits=ServerLimits(max_sessions=300)) as srv:
            r = await idle_connections(srv, url(srv), TOKEN, n=300, extra=20)
            assert r["refused"] == 20 and r["extra_statuses"] == [503]
            assert r["rss_kb_per_connection_both_ends"] < 200  # a generous bound; the bench reports the figure
    run(go(), timeout=60)


def test_slow_reader_cannot_grow_server_buffers_and_others_are_served() -> None:
    lim = ServerLimits(max_outbox_events=512, write_buffer_bytes=64 * 1024, send_timeout_s=1.0,
                       max_messages_per_s=1e4, burst_messages=1e4, max_bytes_per_s=1e9, burst_bytes=1e9)

    async def go() -> None:
        async with running_server(limits=lim) as srv:
            from tests.reliability.live import connect_auth

            good = await connect_auth(url(srv), TOKEN)
            ref = await text_turn(good, "hello there")
            r = await slow_reader(srv, url(srv), TOKEN)
            assert r["closed_as_slow"]
            assert r["outbox_events"] <= lim.max_outbox_events
            # websockets' write limit is a high-water mark: one message may overshoot it
            assert r["write_buffer_bytes"] <= lim.write_buffer_bytes + 512 * 1024
            assert await text_turn(good, "hello there") == ref
            await good.close()
    run(go(), timeout=60)


def test_server_process_keeps_accepting_past_a_pipes_worth_of_log_lines() -> None:
    """Regression: `tristream serve` logs a line per connection; an unread stderr pipe (64 KiB)
    once blocked its event loop after ~1,000 connections. 1,500 idle sessions, then a refusal."""
    import asyncio
    import signal

    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    from tests.reliability.shutdown import raise_nofile_limit, start_server

    n = 1500
    if raise_nofile_limit() < n + 200:
        pytest.skip(f"this process may not open {n + 200} files (ulimit -Hn)")
    proc, port = start_server(TOKEN, pace=0.0, max_sessions=n)
    u = f"ws://127.0.0.1:{port}/v1/realtime"
    hdr = {"Authorization": f"Bearer {TOKEN}"}

    async def go() -> int:
        conns = []
        for _ in range(0, n, 100):
            conns += await asyncio.gather(*(connect(u, additional_headers=hdr, open_timeout=20, ping_interval=None)
                                            for _k in range(100)))
        try:
            async with connect(u, additional_headers=hdr, open_timeout=20):
                status = 101
        except InvalidStatus as e:
            status = e.response.status_code
        await asyncio.gather(*(c.close() for c in conns))
        return status

    try:
        assert run(go(), timeout=60) == 503
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_connections_past_the_open_file_limit_are_refused_not_left_hanging() -> None:
    import asyncio
    import os
    import resource
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    root = Path(__file__).resolve().parents[2]

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    with open(os.devnull, "w") as devnull:
        proc = subprocess.Popen([sys.executable, "-c", "from tristream.cli import main; main()", "serve", "--port",
                                 "0", "--token", TOKEN, "--backend", "echo", "--pace", "0", "--max-sessions", "1000"],
                                cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.PIPE,
                                stderr=devnull, text=True, preexec_fn=low_soft_limit)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    port = int(line.split()[0].rsplit(":", 1)[1].split("/")[0])
    u = f"ws://127.0.0.1:{port}/v1/realtime"

    async def one() -> tuple[object, str]:
        try:
            ws = await connect(u, additional_headers={"Authorization": f"Bearer {TOKEN}"}, open_timeout=3,
                               ping_interval=None)
            return ws, "101"
        except InvalidStatus as e:
            return None, str(e.response.status_code)
        except TimeoutError:
            return None, "hung"

    async def go() -> list[str]:
        res: list[tuple[object, str]] = []
        for _ in range(6):
            res += await asyncio.gather(*(one() for _ in range(50)))
        await asyncio.gather(*(ws.close() for ws, _ in res if ws is not None))  # type: ignore[attr-defined]
        return [s for _, s in res]

    try:
        statuses = run(go(), timeout=60)
        assert isinstance(statuses, list)
        assert "hung" not in statuses, f"{statuses.count('hung')} of 300 connections hung past the open-file limit"
        assert set(statuses) <= {"101", "503"}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
