"""Decode ms per `LLMEngine.step()` with overlapped decode off vs on (GPU, issue #3).

A synchronous step leaves the GPU idle during its host side (scheduling, input copy, graph
launch, token read-back, accepting tokens): bench/llm.py measured 1.04 ms per step for
SmolLM2-135M against a 0.92 ms graph replay. With `EngineConfig.overlap` the next step is
launched (its token ids fed on the device) before the host waits for the current one.

Per model (random bf16 weights, `bench.llm.random_model`; one engine, graphs captured once) and
batch size (128-token random prompts, steady greedy decode): ms per `step()` call (median, mean,
p90) with overlap off and on, the decode graph's replay time alone, how many of the timed steps
ran ahead, and whether both modes produced the same tokens (every sequence, from its first).

    python3 bench/step_overlap.py [--models smollm2-135m,llama-3.2-1b] [--batches 1,8] [--steps 300]
                                  [--kernels cublas|auto|b1|b8_pdl|...] [--name step_overlap]
    python3 bench/step_overlap.py --kernels b1_pdl --batches 1 --name step_overlap_b1pdl

A batch-1 variant (`--kernels b1_pdl`) runs buckets above 1 through the slow 'fused' GEMMs:
measure it at batch 1 only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench._common import engine_graph_ms, write_results  # noqa: E402


def _engine(model: Any, kernels: str, buckets: tuple[int, ...]) -> Any:
    from tristream.engine.engine import EngineConfig, LLMEngine

    eng = LLMEngine(model, None, EngineConfig(block_size=16, kv_cache_bytes=4 << 30, max_model_len=4096,
                                              max_prefill_tokens=2048, enable_prefix_cache=False,
                                              decode_kernels=kernels, graph_buckets=buckets))
    if eng.runner.decoder is not None:  # decode graphs only: prefill is not measured (its kernels compile on use)
        eng.runner.decoder.capture()
    else:
        eng.runner.capture()
    torch.cuda.synchronize()
    return eng


def _idle(eng: Any) -> None:
    for sid in list(eng.seqs):
        eng.cancel(sid)
    while eng.has_work():
        eng.step()


def _replay_ms(eng: Any, batch: int) -> float | None:
    return engine_graph_ms(eng, batch)


def run_mode(eng: Any, batch: int, overlap: bool, steps: int, vocab: int, profile: bool = False
             ) -> tuple[dict[str, Any], list[list[int]]]:
    """Steady decode of `batch` sequences; step times and every sequence's tokens."""
    from tristream.engine.sequence import SamplingParams

    _idle(eng)
    eng.set_overlap(overlap)
    gen = torch.Generator().manual_seed(1000 + batch)
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    ids = [eng.add_request(torch.randint(10, vocab, (128,), generator=gen).tolist(), params) for _ in range(batch)]
    toks: dict[int, list[int]] = {i: [] for i in ids}

    def step() -> None:
        for o in eng.step():
            if o.token_id is not None and o.seq_id in toks:
                toks[o.seq_id].append(o.token_id)

    while any(not s.is_decode for s in eng.seqs.values()) or len(eng.seqs) < batch:
        step()
    for _ in range(8):
        step()
    ahead0 = eng.stats.overlap_steps
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    ahead = eng.stats.overlap_steps - ahead0
    prof = None
    if profile:  # every kernel of 20 steady steps, graph replays and what runs between them
        from bench._common import kernel_profile

        prof = kernel_profile(lambda: [step() for _ in range(20)], top=30)
        prof = {"kernels_per_step": prof["kernels"] / 20, "kernel_us_per_step": round(prof["kernel_time_us"] / 20, 1),
                "top": [{"kernel": r["kernel"][:100], "per_step": r["count"] / 20, "us_per_step": round(r["us"] / 20, 2)}
                        for r in prof["top"]]}
    _idle(eng)
    ms = sorted(x * 1e3 for x in ts)
    res = {"ms_per_step_median": statistics.median(ms), "ms_per_step_mean": statistics.fmean(ms),
           "ms_per_step_p90": ms[int(0.9 * (len(ms) - 1))], "tokens_per_s": batch / (statistics.fmean(ms) / 1e3),
           "steps_run_ahead": ahead, "steps_timed": steps, **({"profile_per_step": prof} if prof else {})}
    return res, [toks[i] for i in ids]


def bench_model(name: str, batches: list[int], steps: int, kernels: str, profile: bool = False) -> dict[str, Any]:
    from bench.llm import random_model

    model = random_model(name)
    t0 = time.perf_counter()
    buckets = tuple(sorted({1, *batches}))  # only what is measured: capture stays short
    eng = _engine(model, kernels, buckets)
    out: dict[str, Any] = {"capture_s": round(time.perf_counter() - t0, 2), "kernels": kernels, "batches": {}}
    dec = eng.runner.decoder
    if dec is not None:
        out["variant_per_bucket"] = {b: dec.variant_for(b) for b in dec.buckets}
    for batch in batches:
        off, toks_off = run_mode(eng, batch, False, steps, model.cfg.vocab_size)
        on, toks_on = run_mode(eng, batch, True, steps, model.cfg.vocab_size, profile)
        # both modes start from the same prompts; compare each sequence over the tokens both produced
        pairs = [(x[:min(len(x), len(y))], y[:min(len(x), len(y))]) for x, y in zip(toks_off, toks_on, strict=True)]
        same = all(x == y for x, y in pairs)
        first_diff = None
        if not same:
            first_diff = min(next((j for j, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                             for x, y in pairs)
        replay = _replay_ms(eng, batch)
        row = {"overlap_off": off, "overlap_on": on, "graph_replay_ms": replay, "tokens_equal": same,
               "tokens_compared": sum(len(x) for x, _ in pairs), "first_mismatch_index": first_diff,
               "speedup_median": off["ms_per_step_median"] / on["ms_per_step_median"]}
        out["batches"][batch] = row
        print(f"{name:14s} b={batch:<3d} off {off['ms_per_step_median']:.3f} ms  on {on['ms_per_step_median']:.3f} ms"
              f"  (mean {off['ms_per_step_mean']:.3f} / {on['ms_per_step_mean']:.3f})  replay "
              f"{replay if replay is None else round(replay, 3)} ms  ahead {on['steps_run_ahead']}/{steps}"
              f"  tokens equal: {same}", flush=True)
    del eng, model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kernels", default="cublas", help="EngineConfig.decode_kernels ('auto' times variants: slow)")
    ap.add_argument("--name", default="step_overlap", help="results file name under bench/results/")
    ap.add_argument("--profile", action="store_true", help="also profile 20 overlapped steps' kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/step_overlap.py needs a CUDA GPU")
    batches = [int(x) for x in args.batches.split(",")]
    res: dict[str, Any] = {"steps": args.steps, "models": {}}
    for name in args.models.split(","):
        res["models"][name] = bench_model(name, batches, args.steps, args.kernels, args.profile)
        path = write_results(args.name, res)  # after every model: a run cut short keeps what it measured
        out = os.environ.get("OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / path.name).write_text(path.read_text())
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
