"""Where a served turn's first-token time goes: the engine alone vs the `AsyncLLM` front end.

Each turn extends a session's history (prefix-cache hit on its full blocks) with a short user
message and asks for a 16-token answer, as `tristream.scale.engine_backend` does. Measured:

1. `engine`: `add_request` then `step()` on this thread until the first token (no threads).
2. `async`: `AsyncLLM.submit` from an asyncio loop until the stream's first delta (engine on
   its own thread), alone and with `--background` other sessions generating meanwhile.

    python3 bench/async_latency.py                      # GPU, llama-3.2-1b random weights
    .venv/bin/python bench/async_latency.py --device cpu --model tiny-random
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import nearest_rank_pct as _pct  # noqa: E402
from bench._common import write_results  # noqa: E402


def _row(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50_ms": _pct(xs, 50), "p99_ms": _pct(xs, 99), "mean_ms": statistics.fmean(xs)}


def engine_turns(eng: Any, turns: int, vocab: int) -> list[float]:
    from tristream.engine.sequence import SamplingParams

    rng = random.Random(0)
    history = [rng.randrange(3, vocab) for _ in range(200)]
    out = []
    for _ in range(turns):
        history += [rng.randrange(3, vocab) for _ in range(12)]
        t0 = time.perf_counter()
        sid = eng.add_request(list(history), SamplingParams(max_tokens=16, ignore_eos=True))
        first = None
        while True:
            for o in eng.step():
                if o.seq_id == sid and o.token_id is not None:
                    if first is None:
                        first = (time.perf_counter() - t0) * 1e3
                    history.append(o.token_id)
                if o.seq_id == sid and o.finished:
                    break
            else:
                continue
            break
        assert first is not None
        out.append(first)
    return out


async def async_turns(llm: Any, turns: int, vocab: int, background: int) -> list[float]:
    from tristream.engine.sequence import SamplingParams

    llm.loop = asyncio.get_running_loop()  # a fresh loop per asyncio.run
    stop = False

    async def other(i: int) -> None:
        rng = random.Random(100 + i)
        hist = [rng.randrange(3, vocab) for _ in range(200)]
        while not stop:
            hist += [rng.randrange(3, vocab) for _ in range(12)]
            async for d in llm.submit(list(hist), SamplingParams(max_tokens=16, ignore_eos=True)):
                if d.token_id is not None:
                    hist.append(d.token_id)
            await asyncio.sleep(0.5 * (0.5 + rng.random()))

    tasks = [asyncio.create_task(other(i)) for i in range(background)]
    await asyncio.sleep(1.0 if background else 0)
    rng = random.Random(0)
    history = [rng.randrange(3, vocab) for _ in range(200)]
    out = []
    for _ in range(turns):
        history += [rng.randrange(3, vocab) for _ in range(12)]
        t0 = time.perf_counter()
        first = None
        async for d in llm.submit(list(history), SamplingParams(max_tokens=16, ignore_eos=True)):
            if d.token_id is not None:
                if first is None:
                    first = (time.perf_counter() - t0) * 1e3
                history.append(d.token_id)
        assert first is not None
        out.append(first)
        await asyncio.sleep(0.05)
    stop = True
    await asyncio.gather(*tasks)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--background", type=int, nargs="+", default=[0, 16, 32])
    p.add_argument("--name", default="async_latency")
    a = p.parse_args()
    import torch

    from tristream.engine.async_engine import AsyncLLM
    from tristream.sched.real import build_engine

    torch.set_grad_enabled(False)
    eng = build_engine(a.model, a.device, (8 << 30) if a.device == "cuda" else (64 << 20))
    vocab = int(eng.model.cfg.vocab_size)
    engine_turns(eng, 5, vocab)  # warm-up
    res: dict[str, Any] = {"model": a.model, "device": a.device, "engine": _row(engine_turns(eng, a.turns, vocab))}
    print(f"engine alone           first token P50 {res['engine']['p50_ms']:.2f} ms  P99 {res['engine']['p99_ms']:.2f}")
    llm = AsyncLLM(eng)
    for bg in a.background:
        r = _row(asyncio.run(async_turns(llm, a.turns, vocab, bg)))
        res[f"async_bg{bg}"] = r
        print(f"AsyncLLM, {bg:3d} others  first token P50 {r['p50_ms']:.2f} ms  P99 {r['p99_ms']:.2f}")
    llm.shutdown()
    write_results(a.name, res)


if __name__ == "__main__":
    main()
