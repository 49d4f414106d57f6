"""The ingress relay (`Relay`, `ReplicaLink`) against a replica's real `WireServer` on loopback.

Only the Ray control plane is stood in for (``relay_endpoint.remote()`` returns the server's
endpoint, as the replica actor's method does); the frames go over the real socket.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tests.serve.helpers import run
from tristream.scale.relay import REPLICA_FAILED, SLOW_CLIENT, End, Relay, SessionPipe
from tristream.scale.wire import EVENT, WireServer


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class _ReplicaHandle:
    """What a link calls on an engine replica's actor handle in socket mode."""

    def __init__(self, srv: WireServer) -> None:
        self.relay_endpoint = _Method(lambda: srv.start("127.0.0.1"))


async def _drain(pipe: SessionPipe, n: int) -> list[str | End]:
    return [await asyncio.wait_for(pipe.outbox.get(), 5) for _ in range(n)]


def test_messages_queued_before_the_stream_opens_arrive_in_order_and_events_come_back() -> None:
    async def go() -> None:
        got: asyncio.Queue[tuple[str, str | bytes]] = asyncio.Queue()
        srv = WireServer(lambda ing, sid, data: got.put_nowait((sid, data)), lambda n, r: None, lambda i: None)
        counted: list[tuple[str, str]] = []
        relay = Relay(max_outbox_events=100, count=lambda name, label: counted.append((name, label)))
        a, b = relay.expect("sess_a"), relay.expect("sess_b")
        link = relay.attach("sess_a", "r0", _ReplicaHandle(srv))
        assert relay.attach("sess_b", "r0", None) is link  # one link per replica
        for k in range(3):  # pushed before the connection exists: kept, then sent in order
            link.push("sess_a", f"a{k}")
        link.push("sess_b", b"\x01")
        assert [await asyncio.wait_for(got.get(), 5) for _ in range(4)] == [
            ("sess_a", "a0"), ("sess_a", "a1"), ("sess_a", "a2"), ("sess_b", b"\x01")]
        outlet = srv.outlets[relay.ingress_id]
        outlet.send(EVENT, "sess_b", b'{"type":"x"}')
        outlet.send(EVENT, "sess_a", b'{"type":"y"}')
        outlet.send(EVENT, "sess_gone", b"{}")  # a session this ingress no longer has: counted, dropped
        assert await _drain(b, 1) == ['{"type":"x"}'] and await _drain(a, 1) == ['{"type":"y"}']
        assert counted == [("relay_dropped", "session_gone")]
        await relay.close()
        srv.close()

    run(go(), timeout=30)


def test_slow_client_and_replica_death_end_sessions_with_a_reason() -> None:
    async def go() -> None:
        counted: list[tuple[str, str]] = []
        connected = asyncio.Event()
        srv = WireServer(lambda ing, sid, data: None, lambda n, r: None, lambda i: connected.set())
        relay = Relay(max_outbox_events=4, count=lambda name, label: counted.append((name, label)))
        slow, ok = relay.expect("sess_slow"), relay.expect("sess_ok")
        link = relay.attach("sess_slow", "r0", _ReplicaHandle(srv))
        relay.attach("sess_ok", "r0", None)
        await asyncio.wait_for(connected.wait(), 5)
        outlet = srv.outlets[relay.ingress_id]
        for k in range(6):  # nobody drains sess_slow's outbox: past 4 events it is ended
            outlet.send(EVENT, "sess_slow", f"e{k}".encode())
        assert await _drain(slow, 5) == ["e0", "e1", "e2", "e3", End(SLOW_CLIENT)]
        assert ("relay_dropped", SLOW_CLIENT) in counted
        outlet.transport.close()  # the replica's side goes away (its process died)
        assert await _drain(ok, 1) == [End(REPLICA_FAILED)]
        assert link.dead and "r0" not in relay.links
        link.push("sess_ok", "late")  # after the failure: counted, not sent
        assert ("relay_dropped", REPLICA_FAILED) in counted
        srv.close()

    run(go(), timeout=30)
