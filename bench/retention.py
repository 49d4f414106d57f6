"""KV retention on CPU: a long text conversation with and without a KV budget (SmolLM2-135M GGUF).

The conversation is built from the Python documentation shipped with the interpreter
(`pydoc_data.topics`: stable text, no download): each turn the user asks about a topic and the
assistant answers with the start of its documentation. N continuations then ask about topics
from early in the conversation (answers in what eviction removes first) and N about the last
topics (answers inside the kept text window).
Every continuation runs once per budget, each as a fresh sequence fed the whole conversation
(prefix cache off, so a budgeted run really evicts while it prefills, as a live session would),
and greedy-decodes `--tokens` tokens.

Reported per budget: greedy token agreement with the unbudgeted run (position-wise match rate
and common-prefix length), KV blocks the sequence held (peak), per-token decode time (median
over steps), prefill time, evictions by reason. Writes `bench/results/retention_cpu.json`.

    .venv/bin/python bench/retention.py            # defaults: 2 x 6 continuations, 32 tokens, budgets 256/512/1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write_results  # noqa: E402

TOPICS = ("assignment", "if", "while", "for", "try", "with", "function", "class", "lambda", "import",
          "return", "yield", "global", "nonlocal", "raise", "assert", "del", "pass", "break", "continue",
          "async", "atom-identifiers", "numbers", "strings", "lists", "dict", "typesseq", "typesmapping",
          "comparisons", "booleans", "conditional", "slicings", "calls", "power", "unary", "binary", "shifting")


def conversation(tok: Any, words_per_answer: int, target_tokens: int) -> tuple[list[dict[str, str]], list[str]]:
    """Chat messages of about `target_tokens` tokens and the topics they cover, in order."""
    from pydoc_data.topics import topics

    msgs: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant who knows Python well."}]
    used: list[str] = []
    for t in TOPICS:
        if t not in topics:
            continue
        words = topics[t].split()
        msgs.append({"role": "user", "content": f"Tell me about {t} in Python."})
        msgs.append({"role": "assistant", "content": " ".join(words[:words_per_answer])})
        used.append(t)
        if len(tok.apply_chat_template(msgs, add_generation_prompt=False)) >= target_tokens:
            break
    return msgs, used


def run_one(eng: Any, prompt: list[int], budget: int | None, tokens: int) -> dict[str, Any]:
    """Feed the prompt as one sequence, greedy-decode; time prefill and each decode step."""
    from tristream.engine.sequence import SamplingParams

    ev0 = dict(eng.stats.retention.evicted_blocks)
    sid = eng.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), kv_budget_tokens=budget)
    out: list[int] = []
    peak = 0
    t0 = time.perf_counter()
    t_first: float | None = None
    step_s: list[float] = []
    while True:
        ts = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - ts
        seq = eng.seqs.get(sid)
        if seq is not None:
            peak = max(peak, len(seq.block_table))
        got = [o for o in outs if o.seq_id == sid and o.token_id is not None]
        if got:
            if t_first is None:
                t_first = time.perf_counter() - t0
            else:
                step_s.append(dt)
            out += [o.token_id for o in got]  # type: ignore[misc]
        if any(o.finished for o in outs if o.seq_id == sid):
            break
    evicted = {k: v - ev0.get(k, 0) for k, v in eng.stats.retention.evicted_blocks.items() if v - ev0.get(k, 0)}
    return {"tokens": out, "peak_blocks": peak, "prefill_s": t_first, "decode_step_s": step_s, "evicted": evicted}


def probe_cost(eng: Any, tokens: list[int], contexts: tuple[int, ...] = (512, 1024, 2048), reps: int = 5
               ) -> dict[str, float]:
    """Median wall time (ms) of one attention-mass probe (eviction time only) by context length."""
    from tristream.engine.retention_probe import attention_probe

    out: dict[str, float] = {}
    for n in contexts:
        ids = (tokens * (n // len(tokens) + 1))[:n]
        sid = eng.add_request(ids, generate=False)
        while eng.has_work():
            eng.step()
        seq = eng.seqs[sid]
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            attention_probe(eng.model, eng.cache, seq)
            times.append(1e3 * (time.perf_counter() - t))
        out[str(n)] = statistics.median(times)
        eng.close(sid)
        eng.step()
        print(f"probe at context {n}: {out[str(n)]:.1f} ms")
    return out


def fit_overhead_ns(eng: Any, n: int = 200_000) -> dict[str, float]:
    """Host cost the retention check adds per decode sequence and step (`KVRetention.fit(seq, 1)`),
    without a budget and with one not reached."""
    import timeit

    from tristream.engine.sequence import Sequence

    s = Sequence(keys=list(range(3, 200)))
    s.block_table, s.num_computed = list(range(13)), 196
    off = 1e9 * timeit.timeit(lambda: eng.retention.fit(s, 1), number=n) / n
    s.kv_budget_tokens = 1024
    under = 1e9 * timeit.timeit(lambda: eng.retention.fit(s, 1), number=n) / n
    return {"no_budget": off, "budget_not_reached": under}


def agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    match = sum(x == y for x, y in zip(a, b, strict=False)) / max(1, len(a))
    prefix = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        prefix += 1
    return match, prefix


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--continuations", type=int, default=6, help="questions per kind (early, recent)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--context", type=int, default=1800, help="conversation length in tokens (about)")
    ap.add_argument("--words", type=int, default=70, help="words per assistant answer")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quant", default="int4", choices=["int4", "int8", "none"])
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tristream.engine.cli_support import default_model_path
    from tristream.engine.engine import EngineConfig, LLMEngine
    from tristream.engine.kv_retention import RetentionConfig
    from tristream.engine.sequence import SamplingParams

    path = default_model_path()
    load_start = list(os.getloadavg())
    budgets = [int(b) for b in args.budgets.split(",")]
    bs = args.block_size
    engines: dict[str, Any] = {}
    t = time.perf_counter()
    base = LLMEngine.from_path(path, quant=None if args.quant == "none" else args.quant,
                               config=EngineConfig(block_size=bs, max_model_len=4096, enable_prefix_cache=False))
    load_s = time.perf_counter() - t
    tok = base.tokenizer
    assert tok is not None
    engines["none"] = base
    for b in budgets:  # same weights, own cache and retention knobs (text window = half the budget)
        rc = RetentionConfig(sink_tokens=4, text_window_tokens=b // 2)
        engines[str(b)] = LLMEngine(base.model, tok, EngineConfig(block_size=bs, max_model_len=4096,
                                                                 enable_prefix_cache=False, retention=rc))
    msgs, used = conversation(tok, args.words, args.context)
    n = args.continuations
    kinds = ["early"] * n + ["recent"] * n  # about the first topics (evicted first) / the last ones (in the window)
    questions = [f"Earlier you told me about {t} in Python. Remind me what you said about {t}."
                 for t in used[:n] + used[::-1][:n]]
    prompts = [tok.apply_chat_template(msgs + [{"role": "user", "content": q}]) for q in questions]
    print(f"conversation: {len(used)} topics, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    base.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (dense prefill weights)
    for e in engines.values():
        e.generate([prompts[0][:64]], SamplingParams(max_tokens=4, ignore_eos=True))
    per: dict[str, list[dict[str, Any]]] = {k: [] for k in engines}
    for i, p in enumerate(prompts):  # interleave configs so load changes hit all of them
        for k, e in engines.items():
            r = run_one(e, p, None if k == "none" else int(k), args.tokens)
            per[k].append(r)
            print(f"continuation {i} budget {k:>5}: peak blocks {r['peak_blocks']:4d}, "
                  f"prefill {r['prefill_s']:.2f} s, decode {1e3 * statistics.median(r['decode_step_s']):.1f} ms/token")
    results: dict[str, Any] = {
        "model": str(path.name), "quant": args.quant, "threads": args.threads, "block_size": bs,
        "continuations": len(prompts), "tokens_per_continuation": args.tokens,
        "prompt_tokens": [len(p) for p in prompts], "topics_in_conversation": len(used), "load_s": load_s,
        "by_budget": {}, "load_avg_start": load_start, "load_avg_end": list(os.getloadavg()),
    }
    ref = per["none"]
    for k, runs in per.items():
        agree = [agreement(r0["tokens"], r["tokens"]) for r0, r in zip(ref, runs, strict=True)]
        steps = [s for r in runs for s in r["decode_step_s"]]
        evicted: dict[str, int] = {}
        for r in runs:
            for reason, n in r["evicted"].items():
                evicted[reason] = evicted.get(reason, 0) + n
        results["by_budget"][k] = {
            "budget_tokens": None if k == "none" else int(k),
            "text_window_tokens": None if k == "none" else int(k) // 2,
            "token_match_rate": statistics.mean(a for a, _ in agree),
            "common_prefix_tokens_mean": statistics.mean(p for _, p in agree),
            "exact_continuations": sum(a == 1.0 for a, _ in agree),
            "by_question": {kind: {"token_match_rate": statistics.mean(a for (a, _), k2 in zip(agree, kinds, strict=True)
                                                                      if k2 == kind),
                                   "common_prefix_tokens_mean": statistics.mean(
                                       p for (_, p), k2 in zip(agree, kinds, strict=True) if k2 == kind)}
                            for kind in ("early", "recent")},
            "peak_kv_blocks_mean": statistics.mean(r["peak_blocks"] for r in runs),
            "peak_kv_blocks_max": max(r["peak_blocks"] for r in runs),
            "decode_ms_per_token_median": 1e3 * statistics.median(steps),
            "decode_ms_per_token_p90": 1e3 * sorted(steps)[int(0.9 * (len(steps) - 1))],
            "prefill_s_median": statistics.median(r["prefill_s"] for r in runs),
            "evicted_blocks": evicted,
            "probes": engines[k].stats.retention.probes,
            "preemptions": engines[k].stats.preemptions,
        }
    results["probe_ms_by_context"] = probe_cost(base, prompts[0])
    results["fit_overhead_ns_per_decode_seq_step"] = fit_overhead_ns(base)
    print("retention check per decode sequence and step (ns):", results["fit_overhead_ns_per_decode_seq_step"])
    print(f"{'budget':>7} {'match':>6} {'early':>6} {'recent':>6} {'prefix':>6} {'peak blk':>8} {'ms/tok':>7} "
          f"{'prefill s':>9}")
    for k, r in results["by_budget"].items():
        q = r["by_question"]
        print(f"{k:>7} {r['token_match_rate']:6.2f} {q['early']['token_match_rate']:6.2f} "
              f"{q['recent']['token_match_rate']:6.2f} {r['common_prefix_tokens_mean']:6.1f} "
              f"{r['peak_kv_blocks_max']:8d} {r['decode_ms_per_token_median']:7.1f} {r['prefill_s_median']:9.2f}")
    print(write_results("retention_cpu", results))


if __name__ == "__main__":
    main()
