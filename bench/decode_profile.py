"""Where a batch-1 (and batch-2) decode step's time goes, per kernel variant (GPU only).

One engine per model (random bf16 weights, a 128-token prompt, steady decode); for every variant
of `tristream.engine.kernel_choice.VARIANTS` at buckets 1 and 2:
* the logits' relative error against the cuBLAS path and whether the greedy tokens agree;
* the graph replay time (ms);
* the kernels of one replay from the profiler: how many, their summed time, and the top ones,
  so that launch-bound gaps (replay time minus kernel time) and slow kernels are told apart.

    python3 bench/decode_profile.py --models smollm2-135m,llama-3.2-1b   # writes bench/results/decode_profile.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench._common import kernel_profile, write_results  # noqa: E402


def _engine(model: Any) -> Any:
    from tristream.engine.engine import EngineConfig, LLMEngine

    eng = LLMEngine(model, None, EngineConfig(block_size=16, kv_cache_bytes=4 << 30, max_model_len=4096,
                                              max_prefill_tokens=2048, enable_prefix_cache=False,
                                              decode_kernels="cublas", graph_buckets=(1, 2, 4)))
    eng.runner.capture()
    return eng


def _steady(eng: Any, batch: int, vocab: int, ctx: int = 128) -> None:
    """`batch` sequences of `ctx` prompt tokens, decoding: the decode buffers hold a real step."""
    from tristream.engine.sequence import SamplingParams

    for sid in list(eng.seqs):
        eng.cancel(sid)
    eng.step()
    gen = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        eng.add_request(torch.randint(10, vocab, (ctx,), generator=gen).tolist(),
                        SamplingParams(max_tokens=64, ignore_eos=True))
    while any(not s.is_decode for s in eng.seqs.values()) or len(eng.seqs) < batch:
        eng.step()
    for _ in range(4):
        eng.step()
    torch.cuda.synchronize()


def _kernel_table(dec: Any, b: int, v: str, eager: torch.Tensor, reps: int = 10, top: int = 12) -> dict[str, Any]:
    """Kernels of one replay of bucket b's graph in variant v (profiled over `reps` replays), and
    whether replays repeat bit for bit and equal the eager run `eager`."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = dec.forward(b, v)
    runs = []
    for _ in range(8):
        g.replay()
        runs.append(out.clone())
    torch.cuda.synchronize()
    repeat_equal = all(torch.equal(runs[0], r) for r in runs[1:])
    eager_err = float((runs[0] - eager).norm() / eager.norm().clamp(min=1e-30))

    def replays() -> None:
        for _ in range(reps):
            g.replay()

    prof = kernel_profile(replays, top=top)  # the graph is freed when this returns
    return {"replays_bitwise_equal": repeat_equal, "graph_equals_eager": bool(torch.equal(runs[0], eager)),
            "graph_vs_eager_rel_err": eager_err, "kernels_per_step": prof["kernels"] / reps, "kernel_us_per_step": round(prof["kernel_time_us"] / reps, 1),
            "top": [{"kernel": r["kernel"][:110], "per_step": r["count"] / reps, "us_per_step": round(r["us"] / reps, 1),
                     "us_mean": round(r["us"] / r["count"], 2)} for r in prof["top"]]}


def profile_model(name: str, buckets: list[int], variants: list[str] | None = None) -> dict[str, Any]:
    from llm import random_model

    model = random_model(name)
    t0 = time.perf_counter()
    eng = _engine(model)
    out: dict[str, Any] = {"capture_s": round(time.perf_counter() - t0, 2), "buckets": {}}
    dec = eng.runner.decoder
    with torch.inference_mode():
        _profile_buckets(name, eng, dec, model.cfg.vocab_size, buckets, out, variants)
    del eng, model
    torch.cuda.empty_cache()
    return out


def _profile_buckets(name: str, eng: Any, dec: Any, vocab: int, buckets: list[int], out: dict[str, Any],
                     variants: list[str] | None = None) -> None:
    from tristream.engine.kernel_choice import B1_VARIANTS, VARIANTS

    for b in buckets:
        _steady(eng, b, vocab)
        ref = dec.forward(b, "cublas").clone()
        res: dict[str, Any] = {}
        for v in variants or VARIANTS:
            if v in B1_VARIANTS and b != 1:
                continue
            try:
                got = dec.forward(b, v).clone()
                err = float((got - ref).norm() / ref.norm().clamp(min=1e-30))
                same = bool((got.argmax(-1) == ref.argmax(-1)).all())
                ms = dec._time_variant(b, v)
                table = _kernel_table(dec, b, v, got)
                res[v] = {"rel_err_vs_cublas": err, "greedy_same": same, "replay_ms": round(ms, 4),
                          "launch_gap_us": round(ms * 1e3 - table["kernel_us_per_step"], 1), **table}
                print(f"{name} b={b} {v:<9} replay {ms:.3f} ms  kernels {table['kernels_per_step']:.0f} "
                      f"({table['kernel_us_per_step']:.0f} us busy)  err {err:.2e} same={same} "
                      f"repeat-equal={table['replays_bitwise_equal']} graph=eager={table['graph_equals_eager']}",
                      flush=True)
                for k in table["top"][:6]:
                    print(f"      {k['us_per_step']:8.1f} us  x{k['per_step']:<4g} {k['us_mean']:7.2f} us  {k['kernel'][:80]}",
                          flush=True)
            except Exception as exc:  # one broken variant must not hide the others
                res[v] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                print(f"{name} b={b} {v}: {res[v]['error']}", flush=True)
        out["buckets"][str(b)] = res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--buckets", default="1,2")
    ap.add_argument("--name", default="decode_profile")
    ap.add_argument("--variants", default=None, help="comma-separated subset of graphs.VARIANTS (default all)")
    args = ap.parse_args()
    variants = args.variants.split(",") if args.variants else None
    if not torch.cuda.is_available():
        raise SystemExit("decode_profile.py needs a CUDA GPU (it profiles the decode graphs)")
    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict[str, Any] = {"models": {}}
    for name in args.models.split(","):
        res["models"][name] = profile_model(name, [int(b) for b in args.buckets.split(",")], variants)
        write_results(args.name, res)
    print(f"wrote bench/results/{args.name}.json")


if __name__ == "__main__":
    main()
