"""Where the one-kernel batch-1 decode step (`engine/kernels/decode_mega_cuda.py`) spends its time.

One engine (random bf16 weights, a 128-token prompt, steady decode), then in the same run:

* graph replay ms of the chosen multi-kernel variant (`b8w_pdl_hc` for SmolLM2-135M) and of the
  mega kernel, with their logits' error against the cuBLAS path;
* a timing build of the mega kernel: every warp stamps the GPU global timer before it polls for
  its inputs, once they are there and after its stores, at every stage it takes part in. Per stage
  kind (qkv, attn, o, gate_up, down, head), medians over layers of: the stage's span on the
  critical path (last store of the stage minus last store of the one before), the hand-off (from
  that last store of the stage before to the first / median / last warp having its inputs), the
  work of a warp (inputs there to its stores done), and which warp stored last and why (it started
  late, waited long or worked long); see `_analyse`.

    python3 bench/decode_mega_cuda.py --model smollm2-135m     # writes bench/results/decode_mega_cuda.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench._common import capture_graph, cuda_graph_ms, write_results  # noqa: E402

KINDS = ("qkv", "attn", "o", "gate_up", "down")


def _forward(dec: Any, timing: torch.Tensor | None, store_fence: bool = False) -> torch.Tensor:
    from tristream.engine import graphs
    from tristream.engine.kernels import triton_ops as K
    from tristream.engine.kernels.decode_mega_cuda import decode_logits_mega

    m = dec.model
    splits = K.choose_splits(1, m.cfg.num_heads, dec.num_sms)
    attn = graphs.TritonDecodeAttention(m, dec.cache, dec.positions[:1], dec.slots[:1], dec.block_tables[:1],
                                        dec.ctx_lens[:1], splits, dec.merge_counters)
    return decode_logits_mega(m, m.embed(dec.ids[:1]), attn, timing=timing, store_fence=store_fence)


def _analyse(t: torch.Tensor, nl: int) -> dict[str, Any]:
    """t: [nl*5 + 1, grid*8 warps, 3] int64 ns (0: the warp did not take part).

    Per stage kind, medians over layers (µs): `span` (last store of the stage minus last store of
    the stage before), `handoff_*` (that last store before to the first / median / last warp having
    its inputs), `work_*` (inputs there to its stores done), and about the warp whose stores came
    last: `last_warp` (its index in the block), `last_start_late` (its poll start after the
    stage's median poll start), `last_wait` and `last_work`; `store_p90` (90th percentile of the
    stores after the stage's first store)."""
    t = t.double()
    last_signal = []
    for i in range(nl * 5 + 1):
        s = t[i, :, 2]
        last_signal.append(float(s[s > 0].max()))
    names = ("span", "handoff_first", "handoff_median", "handoff_last", "work_median", "work_max",
             "last_warp", "last_start_late", "last_wait", "last_work", "store_p90")
    per: dict[str, dict[str, list[float]]] = {k: {n: [] for n in names} for k in (*KINDS, "head")}
    for i in range(1, nl * 5 + 1):
        kind = "head" if i == nl * 5 else KINDS[i % 5]
        rows = t[i]
        took = rows[:, 1] > 0
        start, exits, sig = rows[took, 0], rows[took, 1], rows[took, 2]
        prev = last_signal[i - 1]
        d = per[kind]
        d["span"].append((last_signal[i] - last_signal[i - 1]) / 1e3)
        d["handoff_first"].append((float(exits.min()) - prev) / 1e3)
        d["handoff_median"].append((float(exits.median()) - prev) / 1e3)
        d["handoff_last"].append((float(exits.max()) - prev) / 1e3)
        work = (sig - exits) / 1e3
        d["work_median"].append(float(work.median()))
        d["work_max"].append(float(work.max()))
        j = int(sig.argmax())
        d["last_warp"].append(float(took.nonzero()[j].item() % 8))
        d["last_start_late"].append((float(start[j]) - float(start.median())) / 1e3)
        d["last_wait"].append((float(exits[j]) - float(start[j])) / 1e3)
        d["last_work"].append(float(work[j]))
        d["store_p90"].append((float(sig.quantile(0.9)) - float(sig.min())) / 1e3)
    out: dict[str, Any] = {k: {n: round(statistics.median(v), 3) for n, v in d.items() if v} for k, d in per.items()}
    stamps = torch.unique(t[t > 0])
    diffs = stamps[1:] - stamps[:-1]
    out["timer_resolution_ns"] = float(diffs[diffs > 0].min()) if len(diffs) else None
    out["step_us"] = round((last_signal[-1] - float(t[0, :, 0][t[0, :, 0] > 0].min())) / 1e3, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--multi", default="b8w_pdl_hc", help="the multi-kernel variant to compare with")
    ap.add_argument("--name", default="decode_mega_cuda")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_mega_cuda.py needs a CUDA GPU")
    from decode_profile import _engine, _steady
    from llm import random_model

    from tristream.engine.kernels.decode_mega_cuda import stalls, timing_slots

    model = random_model(args.model)
    eng = _engine(model)
    dec = eng.runner.decoder
    res: dict[str, Any] = {"model": args.model, "context_tokens": 128, "variants": {}}
    with torch.inference_mode():
        _steady(eng, 1, model.cfg.vocab_size)
        ref = dec.forward(1, "cublas").clone()

        def record(name: str, got: torch.Tensor, ms: float) -> None:
            err = float((got - ref).norm() / ref.norm())
            res["variants"][name] = {"replay_ms": round(ms, 4), "rel_err_vs_cublas": err,
                                     "greedy_same": bool((got.argmax(-1) == ref.argmax(-1)).all())}
            print(f"{name:<14} replay {ms:.4f} ms  err {err:.2e}", flush=True)

        for v in ("cublas", args.multi):
            record(v, dec.forward(1, v).clone(), dec._time_variant(1, v))
        for name, sf in (("mega", False), ("mega_store_fence", True)):
            got = _forward(dec, None, sf).clone()
            g = capture_graph(lambda f=sf: _forward(dec, None, f))  # type: ignore[misc]
            record(name, got, cuda_graph_ms(g, reps=100))
            del g
        assert stalls(dec.cache) is None, stalls(dec.cache)
        tbuf = torch.zeros(timing_slots(model), dtype=torch.int64, device="cuda")
        got = _forward(dec, tbuf).clone()
        g = capture_graph(lambda: _forward(dec, tbuf))
        record("mega_timing", got, cuda_graph_ms(g, reps=100))
        runs = []
        for _ in range(5):
            tbuf.zero_()
            g.replay()
            torch.cuda.synchronize()
            runs.append(_analyse(tbuf.view(model.cfg.num_layers * 5 + 1, -1, 3).cpu(), model.cfg.num_layers))  # [stage, warp, 3]
        assert stalls(dec.cache) is None, stalls(dec.cache)
        res["stages_us"] = runs[-1]
        res["step_us_runs"] = [r["step_us"] for r in runs]
    for k in (*KINDS, "head"):
        print(f"{k:<8} {res['stages_us'][k]}", flush=True)
    print("timer resolution ns", res["stages_us"]["timer_resolution_ns"], "step us", res["step_us_runs"])
    path = write_results(args.name, res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
