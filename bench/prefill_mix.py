"""Mixed incremental prefill steps on the real engine: the Triton paged prefill kernel (graphed
small steps, and eager) vs the padded-SDPA grouped path (the previous default) in the same run.

The scheduler benchmark's steps append short token runs (8–40 tokens: streamed ASR text, typed
messages, turn tails) to many sessions whose contexts already hold 64–1500 tokens. Each step
here appends such runs to 1–16 random sessions of a 1B-class model (random weights, bf16) and
times the engine step (host + GPU, synchronised). Every variant replays the same seeded steps
on its own fresh sequences. A torch.profiler pass per variant lists the top GPU kernels.

    python3 bench/prefill_mix.py                         # GPU: 1B, 64 sessions, 300 steps
    python3 bench/prefill_mix.py --model smollm2-135m --steps 100
"""

from __future__ import annotations

import argparse
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


def make_steps(n_steps: int, sessions: int, seed: int) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """Initial context length per session and, per step, (session, tokens appended)."""
    rng = random.Random(seed)
    ctx = [rng.randint(64, 1500) for _ in range(sessions)]
    steps = []
    for _ in range(n_steps):
        k = rng.randint(1, 16)
        steps.append([(s, rng.randint(8, 40)) for s in rng.sample(range(sessions), k)])
    return ctx, steps


def run_variant(eng: Any, variant: str, ctx: list[int], steps: list[list[tuple[int, int]]], vocab: int,
                seed: int) -> dict[str, Any]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tristream.engine.kernels.prefill_attention import block_m

    cfg = eng.model.cfg
    runner = eng.runner
    paged = variant.startswith("paged_triton")
    runner.paged_block_m = block_m(cfg.num_heads // cfg.num_kv_heads) if paged else 0
    if not hasattr(runner, "_bench_graphs"):
        runner._bench_graphs = runner.prefill_graphs
    runner.prefill_graphs = runner._bench_graphs if variant == "paged_triton_graphs" else None
    rng = random.Random(seed)
    seqs = [eng.add_request([rng.randrange(3, vocab) for _ in range(n)], generate=False) for n in ctx]
    while eng.has_work():  # prefill the histories (not timed)
        eng.step(max_prefill_tokens=4096)
    torch.cuda.synchronize()
    times: list[float] = []
    tokens: list[int] = []
    ctxs: list[int] = []
    backends = [SDPBackend.EFFICIENT_ATTENTION] if variant == "sdpa_efficient_only" else \
        [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    prof_rows: list[dict[str, Any]] = []
    with sdpa_kernel(backends):
        for i, step in enumerate(steps):
            for s, n in step:
                eng.append(seqs[s], token_ids=[rng.randrange(3, vocab) for _ in range(n)])
            allow = {seqs[s] for s, _ in step}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if i == len(steps) // 2:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    eng.step(allow=allow, max_prefill_tokens=4096)
                    torch.cuda.synchronize()
                for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
                    prof_rows.append({"kernel": ev.key[:90], "calls": ev.count,
                                      "gpu_ms": ev.device_time_total / 1e3})
                continue
            eng.step(allow=allow, max_prefill_tokens=4096)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            tokens.append(sum(n for _, n in step))
            ctxs.append(sum(len(eng.seqs[seqs[s]].keys) for s, _ in step))
    for s in seqs:
        eng.close(s)
    eng.step()
    warm = times[5:]
    per_tok = [t / n for t, n in zip(times[5:], tokens[5:], strict=True)]
    return {"steps": len(warm), "step_ms_p50": _pct(warm, 50), "step_ms_p99": _pct(warm, 99),
            "step_ms_max": max(warm), "step_ms_mean": statistics.fmean(warm),
            "tokens_per_step_mean": statistics.fmean(tokens[5:]), "ms_per_token_p50": _pct(per_tok, 50),
            "first_steps_ms": times[:5], "profile_top_kernels_one_step": prof_rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b", help="preset with random weights")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="paged_triton_graphs,paged_triton,sdpa_grouped,sdpa_efficient_only")
    p.add_argument("--name", default="prefill_mix")
    a = p.parse_args()
    import torch

    from tristream.sched.real import build_engine

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    eng = build_engine(a.model, "cuda", 8 << 30)
    print(f"engine built in {time.perf_counter() - t0:.1f} s", flush=True)
    ctx, steps = make_steps(a.steps, a.sessions, a.seed)
    res: dict[str, Any] = {"model": f"{a.model} (random weights, bf16)", "sessions": a.sessions,
                           "workload": "per step: 1-16 sessions append 8-40 tokens; contexts start at 64-1500",
                           "variants": {}}
    for v in a.variants.split(","):
        r = run_variant(eng, v, ctx, steps, eng.model.cfg.vocab_size, a.seed)
        res["variants"][v] = r
        print(f"{v:>22}: step P50 {r['step_ms_p50']:.2f} ms  P99 {r['step_ms_p99']:.2f}  max {r['step_ms_max']:.1f}"
              f"  ms/token P50 {r['ms_per_token_p50']:.4f}  first steps {[round(x, 1) for x in r['first_steps_ms']]}",
              flush=True)
        for row in r["profile_top_kernels_one_step"]:
            print(f"      {row['gpu_ms']:8.3f} ms  {row['calls']:4d}×  {row['kernel']}")
    base = res["variants"].get("sdpa_grouped")
    ours = res["variants"].get("paged_triton")
    gr = res["variants"].get("paged_triton_graphs")
    if gr and ours:
        res["graphs_speedup_p50"] = ours["step_ms_p50"] / gr["step_ms_p50"]
        print(f"prefill graphs vs eager paged: P50 {res['graphs_speedup_p50']:.2f}x")
    if base and ours:
        res["speedup_p50"] = base["step_ms_p50"] / ours["step_ms_p50"]
        res["speedup_p99"] = base["step_ms_p99"] / ours["step_ms_p99"]
        print(f"paged Triton vs grouped SDPA: P50 {res['speedup_p50']:.2f}x  P99 {res['speedup_p99']:.2f}x")
    write_results(a.name, res)


if __name__ == "__main__":
    main()
