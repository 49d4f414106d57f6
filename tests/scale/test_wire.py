"""The relay's socket data plane (`tristream.scale.wire`) on real loopback sockets, without Ray."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.serve.helpers import run
from tristream.scale.wire import BINARY, EVENT, HELLO, MAX_HELLO, TEXT, RecordProtocol, WireServer, record

_records = st.lists(st.tuples(st.sampled_from([TEXT, BINARY, EVENT]),
                              st.text(alphabet="abcdefghij_0123456789", max_size=40),
                              st.binary(max_size=300)), max_size=20)


@settings(max_examples=200, deadline=None)
@given(recs=_records, cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_records_survive_any_split_of_the_stream(recs: list[tuple[bytes, str, bytes]], cuts: list[int]) -> None:
    """However TCP chops the stream, the same records come out, in order."""
    stream = b"".join(record(k, s, p) for k, s, p in recs)
    got: list[tuple[bytes, str, bytes]] = []
    proto = RecordProtocol(lambda k, s, p: got.append((k, s, p)))
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    for a, b in zip(points, points[1:], strict=False):
        proto.data_received(stream[a:b])
    assert got == recs


def test_server_needs_the_secret_and_batches_a_loop_step_into_one_write() -> None:
    async def go() -> None:
        msgs: asyncio.Queue[tuple[str, str, str | bytes]] = asyncio.Queue()
        counts: list[tuple[str, str]] = []
        connected: list[str] = []
        srv = WireServer(lambda i, s, d: msgs.put_nowait((i, s, d)), lambda n, r: counts.append((n, r)),
                         connected.append)
        ep = await srv.start("127.0.0.1")

        # A stranger (wrong secret) is refused: closed and counted, nothing routed.
        r, w = await asyncio.open_connection(ep.host, ep.port)
        w.write(record(HELLO, "intruder", b"x" * 32) + record(TEXT, "sess_1", b"hi"))
        assert await asyncio.wait_for(r.read(), 5) == b""  # EOF: the replica closed it
        assert counts == [("tristream_relay_refused_total", "bad_hello")] and msgs.empty() and not connected
        w.close()

        # The ingress with the secret: its messages are routed, events come back batched.
        r, w = await asyncio.open_connection(ep.host, ep.port)
        w.write(record(HELLO, "ing-1", ep.secret) + record(TEXT, "sess_1", b'{"type":"x"}')
                + record(BINARY, "sess_2", b"\x00\x01"))
        assert await asyncio.wait_for(msgs.get(), 5) == ("ing-1", "sess_1", '{"type":"x"}')
        assert await asyncio.wait_for(msgs.get(), 5) == ("ing-1", "sess_2", b"\x00\x01")
        assert connected == ["ing-1"]
        outlet = srv.outlets["ing-1"]
        for k in range(5):  # one event-loop step: five records, one write
            outlet.send(EVENT, f"sess_{k % 2}", f"ev{k}".encode())
        got: list[tuple[bytes, str, bytes]] = []
        proto = RecordProtocol(lambda k, s, p: got.append((k, s, p)))
        while len(got) < 5:
            proto.data_received(await asyncio.wait_for(r.read(4096), 5))
        assert [(s, p) for _, s, p in got] == [(f"sess_{k % 2}", f"ev{k}".encode()) for k in range(5)]
        assert srv.totals() == (5, 1)
        w.close()
        while srv.outlets:  # the outlet goes with its connection (a condition wait; run() bounds it)
            await asyncio.sleep(0.01)
        assert srv.totals() == (5, 1)  # its counts stay in the totals
        srv.close()

    run(go(), timeout=30)


def test_corrupt_length_closes_the_stream() -> None:
    async def go() -> None:
        srv = WireServer(lambda i, s, d: None, lambda n, r: None, lambda i: None)
        ep = await srv.start("127.0.0.1")
        r, w = await asyncio.open_connection(ep.host, ep.port)
        w.write(record(HELLO, "ing", ep.secret) + (1 << 30).to_bytes(4, "big") + b"T")
        assert await asyncio.wait_for(r.read(), 5) == b""
        w.close()
        srv.close()

    run(go(), timeout=30)


def test_a_stranger_cannot_make_the_replica_buffer_a_large_first_record() -> None:
    """Before the hello is checked only a small record is accepted: announcing a 32 MiB first
    record closes the connection at once (nothing buffered, counted as refused by the closing)."""
    async def go() -> None:
        connected: list[str] = []
        srv = WireServer(lambda i, s, d: None, lambda n, r: None, connected.append)
        ep = await srv.start("127.0.0.1")
        r, w = await asyncio.open_connection(ep.host, ep.port)
        w.write((32 << 20).to_bytes(4, "big") + b"H" + b"\x00" * 1000)
        assert await asyncio.wait_for(r.read(), 5) == b""
        w.close()
        # a real hello still fits, and after it large records are accepted again
        r, w = await asyncio.open_connection(ep.host, ep.port)
        big = b"x" * (4 * MAX_HELLO)
        got: asyncio.Queue[int] = asyncio.Queue()
        srv.on_message = lambda i, s, d: got.put_nowait(len(d))
        w.write(record(HELLO, "ing", ep.secret) + record(BINARY, "sess_1", big))
        assert await asyncio.wait_for(got.get(), 5) == len(big) and connected == ["ing"]
        w.close()
        srv.close()

    run(go(), timeout=30)


def test_an_ingress_that_stops_reading_loses_its_link_instead_of_events() -> None:
    """Past the write-buffer bound the replica drops the whole link (counted), so the ingress's
    sessions end with an error instead of silently missing events."""
    async def go() -> None:
        counts: list[tuple[str, str]] = []
        gone: list[str] = []
        srv = WireServer(lambda i, s, d: None, lambda n, r: counts.append((n, r)), lambda i: None, gone.append,
                         max_buffer_bytes=64 << 10)
        ep = await srv.start("127.0.0.1")
        r, w = await asyncio.open_connection(ep.host, ep.port)
        w.transport.pause_reading()  # this ingress never reads again
        w.write(record(HELLO, "ing", ep.secret))
        while "ing" not in srv.outlets:
            await asyncio.sleep(0.01)
        outlet = srv.outlets["ing"]
        chunk = b"e" * 16384
        for _ in range(2000):  # far more than the socket buffers and the 64 KiB bound hold
            outlet.send(EVENT, "sess_1", chunk)
            await asyncio.sleep(0)
            if outlet.transport.is_closing():
                break
        assert ("tristream_events_dropped_total", "ingress_backlog") in counts
        while not gone:  # the link is dropped: the replica ends that ingress's sessions
            await asyncio.sleep(0.01)
        assert gone == ["ing"] and "ing" not in srv.outlets
        w.close()
        srv.close()

    run(go(), timeout=30)
