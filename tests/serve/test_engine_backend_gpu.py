"""``--backend engine`` on a GPU: the same server, scheduler and executor as the CPU tests, with
the engine replaying its CUDA graphs (Llama-3.2-1B shape, random bf16 weights).

Needs CUDA (marker ``gpu``) and ``websockets`` (on the GPU machine, carried as a wheel: see
docs/protocol.md "Engine backend"). What is checked: every answer token comes through the
scheduler's plans, 16 concurrent sessions of three tiers are all answered, the decode steps
replayed captured graphs. Latencies are printed, not asserted (``bench/serve.py --backend
engine --device cuda`` measures them).
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("websockets")

MAX_TOKENS = 16


def test_engine_backend_on_cuda_graphs_through_the_scheduler() -> None:
    import torch

    from tests.serve.helpers import TOKEN, count_replays, run, serving, url
    from tristream.serve.client import RealtimeClient
    from tristream.serve.sched_backend import engine_factory
    from tristream.serve.server import RealtimeServer

    f = engine_factory(model="llama-3.2-1b", device="cuda", max_tokens=MAX_TOKENS, kv_bytes=4 << 30)
    se = f.engine
    decoder = se.engine.runner.decoder
    assert decoder is not None and decoder.graphs, "decode graphs were not captured"
    graphs = decoder.graphs
    replays = count_replays(graphs)

    async def client(srv: RealtimeServer, k: int) -> tuple[list[str], list[float]]:
        c = await RealtimeClient.connect(url(srv), TOKEN)
        tier = ("gold", "silver", "bronze")[k % 3]
        await c.send({"type": "session.update", "session": {"modalities": ["text"], "tier": tier}})
        await c.recv(10)
        texts, lat = [], []
        for turn in range(3):
            await c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": f"client {k} turn {turn}: " + "word " * 50}]}})
            t0 = time.perf_counter()
            await c.send({"type": "response.create"})
            text, first = "", None
            while True:
                ev = await c.recv(60)
                assert ev["type"] != "error", ev
                if ev["type"] == "response.text.delta":
                    first = first or (time.perf_counter() - t0) * 1000
                    text += ev["delta"]
                elif ev["type"] == "response.done":
                    assert ev["response"]["status"] == "completed", ev
                    break
            texts.append(text)
            lat.append(first or -1.0)
        await c.close()
        return texts, lat

    async def go() -> list[tuple[list[str], list[float]]]:
        async with serving(f) as srv:
            return await asyncio.gather(*(client(srv, k) for k in range(16)))
    try:
        res = run(go(), timeout=300)
    finally:
        se.shutdown()
    for texts, _ in res:
        for t in texts:
            assert re.fullmatch(r"( t\d+){" + str(MAX_TOKENS) + "}", t), t
    assert se.executor.decode_tokens == 16 * 3 * (MAX_TOKENS - 1)
    assert replays["n"] > 0, "decode ran without graph replays"
    lat = sorted(v for _, ls in res for v in ls)
    print(f"cuda {torch.cuda.get_device_name()}: response.create -> first text ms P50 {lat[len(lat) // 2]:.2f} "
          f"max {lat[-1]:.2f}; graph replays {replays['n']}; steps {se.steps}")
