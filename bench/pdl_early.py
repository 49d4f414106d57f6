"""Batch-1 decode with the PDL trigger at the start of each kernel vs after its wait, and where an
overlapped step's time goes outside its graph (GPU only, issue #3).

`kernels/pdl.py`: mode 1 lets a kernel's successor launch after the kernel's own wait (one kernel of
look-ahead), mode 2 at the kernel's start (the chain launches several kernels ahead). Per model
(random bf16 weights, 128-token prompt, steady decode) and variant, alternating the modes over
several rounds in one process: graph replay ms, and whether the logits are bitwise equal.

Then the engine's overlapped `step()` in each mode (graphs recaptured): ms per step, and for the
first mode a profiler timeline of a few steps: the GPU ops between two decode graphs (input copy,
ids copy, argmax, token read-back) with their durations and the idle gaps, and the host's busy time
per step (the step's wall time less its wait for the token read-back).

    python3 bench/pdl_early.py [--models smollm2-135m,llama-3.2-1b] [--name pdl_early]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench._common import write_results  # noqa: E402

VARIANTS = {"smollm2-135m": ["b8w_pdl_hc", "b1w_pdl"], "llama-3.2-1b": ["bw_pdl", "b1w_pdl"]}


def _set_mode(early: bool) -> None:
    from tristream.engine.kernels import pdl

    pdl.EARLY_TRIGGER = early


def graph_modes(dec: Any, variants: list[str], rounds: int) -> dict[str, Any]:
    """Replay ms of the bucket-1 graph per variant and mode, alternating modes each round."""
    out: dict[str, Any] = {}
    for v in variants:
        ms: dict[str, list[float]] = {"after_wait": [], "early": []}
        logits: dict[str, torch.Tensor] = {}
        for _ in range(rounds):
            for early in (False, True):
                key = "early" if early else "after_wait"
                _set_mode(early)
                eager = dec.forward(1, v).clone()  # compiles this mode's kernels outside the capture
                ms[key].append(dec._time_variant(1, v))
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    o = dec.forward(1, v)
                g.replay()
                torch.cuda.synchronize()
                logits[key] = o.clone()
                logits[key + "_eager"] = eager
                del g
        _set_mode(False)
        a, e = statistics.median(ms["after_wait"]), statistics.median(ms["early"])
        out[v] = {"after_wait_ms": ms["after_wait"], "early_ms": ms["early"], "after_wait_median": a,
                  "early_median": e, "ratio": a / e,
                  "graph_logits_bitwise_equal": bool(torch.equal(logits["early"], logits["after_wait"])),
                  "eager_logits_bitwise_equal": bool(torch.equal(logits["early_eager"], logits["after_wait_eager"]))}
        print(f"  {v:<12} after-wait {a:.4f} ms  early {e:.4f} ms  x{a / e:.3f}  "
              f"bitwise equal: graph {out[v]['graph_logits_bitwise_equal']} eager {out[v]['eager_logits_bitwise_equal']}"
              f"   rounds {[round(x, 4) for x in ms['after_wait']]} / {[round(x, 4) for x in ms['early']]}",
              flush=True)
    return out


def _overlap_engine(model: Any, variant: str) -> Any:
    from tristream.engine.engine import EngineConfig, LLMEngine

    eng = LLMEngine(model, None, EngineConfig(block_size=16, kv_cache_bytes=4 << 30, max_model_len=4096,
                                              max_prefill_tokens=2048, enable_prefix_cache=False,
                                              decode_kernels=variant, graph_buckets=(1,)))
    eng.runner.capture()
    torch.cuda.synchronize()
    return eng


def _recapture(eng: Any) -> None:
    dec = eng.runner.decoder
    torch.cuda.synchronize()
    dec.graphs, dec.outputs, dec.pool = {}, {}, None
    dec.capture()
    torch.cuda.synchronize()


def _start(eng: Any, vocab: int) -> None:
    from tristream.engine.sequence import SamplingParams

    for sid in list(eng.seqs):
        eng.cancel(sid)
    while eng.has_work():
        eng.step()
    gen = torch.Generator().manual_seed(1)
    eng.add_request(torch.randint(10, vocab, (128,), generator=gen).tolist(),
                    SamplingParams(max_tokens=4000, ignore_eos=True))
    while any(not s.is_decode for s in eng.seqs.values()):
        eng.step()
    for _ in range(8):
        eng.step()


def step_times(eng: Any, steps: int) -> dict[str, float]:
    """Median wall ms of `step()` and of the host's part of it (wall less the token wait)."""
    ov = eng.overlap
    assert ov is not None, "overlap is off (CUDA engines default to on)"
    waits: list[float] = []
    real_wait = ov.readback.wait

    def timed_wait(rb: Any) -> list[int]:
        t = time.perf_counter()
        r = real_wait(rb)
        waits.append(time.perf_counter() - t)
        return r

    ov.readback.wait = timed_wait
    walls = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t)
    finally:
        del ov.readback.wait
    host = [w - x for w, x in zip(walls, waits, strict=False)]
    return {"step_ms": statistics.median(walls) * 1e3, "host_busy_ms": statistics.median(host) * 1e3,
            "wait_ms": statistics.median(waits) * 1e3}


def timeline(eng: Any, steps: int = 12) -> dict[str, Any]:
    """The GPU ops of `steps` overlapped steps (profiler), the graph's kernels folded into one span."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    evs = []
    for ev in prof.events():
        if ev.device_type is not None and "CUDA" in str(ev.device_type) and ev.time_range.elapsed_us() >= 0:
            evs.append((ev.time_range.start, ev.time_range.end, ev.name))
    evs.sort()
    if not evs:
        return {"error": "no GPU events"}
    counts: dict[str, int] = {}
    for _, _, n in evs:
        counts[n] = counts.get(n, 0) + 1
    per_step_min = 20 * steps  # a kernel of every layer: part of the graph
    blocks: list[dict[str, Any]] = []
    for s, e, n in evs:
        layer = counts[n] >= per_step_min
        if layer and blocks and blocks[-1]["name"] == "[decode graph layers]":
            blocks[-1]["end"] = e
            blocks[-1]["n"] += 1
        else:
            blocks.append({"name": "[decode graph layers]" if layer else n, "start": s, "end": e, "n": 1})
    t0 = blocks[0]["start"]
    rows = []
    prev_end = None
    for b in blocks:
        gap = None if prev_end is None else b["start"] - prev_end
        rows.append({"op": b["name"][:90], "start_us": round(b["start"] - t0, 2), "dur_us": round(b["end"] - b["start"], 2),
                     "gap_before_us": None if gap is None else round(gap, 2), "kernels": b["n"]})
        prev_end = b["end"]
    graph_starts = [r["start_us"] for r in rows if r["op"] == "[decode graph layers]"]
    periods = [b - a for a, b in zip(graph_starts, graph_starts[1:], strict=False)]
    return {"rows": rows, "gpu_step_period_us": statistics.median(periods) if periods else None}


def engine_modes(model: Any, variant: str, rounds: int, steps: int) -> dict[str, Any]:
    eng = _overlap_engine(model, variant)
    vocab = model.cfg.vocab_size
    res: dict[str, Any] = {"variant": variant, "after_wait": [], "early": []}
    for r in range(rounds):
        for early in (False, True):
            _set_mode(early)
            _recapture(eng)
            _start(eng, vocab)
            t = step_times(eng, steps)
            res["early" if early else "after_wait"].append(t)
            print(f"  engine {variant} {'early' if early else 'after-wait'}: step {t['step_ms']:.4f} ms "
                  f"(host busy {t['host_busy_ms']:.4f}, wait {t['wait_ms']:.4f})", flush=True)
            if r == 0:
                tl = timeline(eng)
                res["timeline_" + ("early" if early else "after_wait")] = tl
                print(f"  GPU step period {tl.get('gpu_step_period_us')} us; one step's ops:", flush=True)
                rows = tl.get("rows", [])
                starts = [i for i, x in enumerate(rows) if x["op"] == "[decode graph layers]"]
                if len(starts) >= 4:
                    for x in rows[starts[2]:starts[3] + 1]:
                        print(f"     {x['start_us']:10.2f} +{x['dur_us']:8.2f} us (gap {x['gap_before_us']}) "
                              f"x{x['kernels']} {x['op']}", flush=True)
    _set_mode(False)
    for k in ("after_wait", "early"):
        res[k + "_step_ms_median"] = statistics.median(x["step_ms"] for x in res[k])
    del eng
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--name", default="pdl_early")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pdl_early.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    from decode_profile import _engine, _steady
    from llm import random_model

    res: dict[str, Any] = {"models": {}}
    for name in args.models.split(","):
        print(name, flush=True)
        model = random_model(name)
        eng = _engine(model)
        dec = eng.runner.decoder
        with torch.inference_mode():
            _steady(eng, 1, model.cfg.vocab_size)
            r = {"graph": graph_modes(dec, VARIANTS[name], args.rounds)}
        del eng
        torch.cuda.empty_cache()
        r["engine"] = engine_modes(model, VARIANTS[name][0], max(2, args.rounds - 1), args.steps)
        res["models"][name] = r
        write_results(args.name, res)
        del model
        torch.cuda.empty_cache()
    print(f"wrote bench/results/{args.name}.json")


if __name__ == "__main__":
    main()
