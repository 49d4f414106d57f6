"""Speculative decoding on real weights (SmolLM2-135M-Instruct, CPU, greedy).

    python bench/spec.py [--quants int4,none] [--max-tokens 128] [--rounds 2] [--threads 2]

For conversations and read-back tasks of our own (`TASKS`): plain greedy generation, then,
step by step along the answer, what the n-gram drafter (`engine/speculative.py`) proposes and
how much of it the target accepts. Greedy verification is exact, so the target's verdict on a
draft at position t is read off the plain answer itself: the accepted length is the longest
prefix of the draft equal to the answer's next tokens. Reported per drafter setting:
- every position: mean draft length, mean accepted length, acceptance rate (accepted / drafted);
- the verify trajectory (what the engine does: verify, advance by accepted + 1, draft again):
  target forwards, tokens per target forward, mean accepted length per verify step.

First the cost of one verify forward of 1 + k positions against a 1-row decode step at the
same context (the speedup model: speedup = tokens per forward x t(decode) / t(verify of k+1)).
Then the engine itself, interleaved per task in the same run: plain decode ('off'), drafts
always ('on'), and drafts only where they pay ('gated': `SpeculativeConfig.row_cost` set from
the measured verify cost of k=4); ms per answer token after the first (the prompt's prefill
excluded), tokens equal to plain decoding, the engine's own acceptance counters.

The machine's two cores are shared with other work: the JSON records the load average and the
steal time over the run; compare the ratios (on/off in the same run), not the absolute ms.
Writes bench/results/spec_cpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench._common import cpu_info, write_results
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.runner import PrefillChunk
from tristream.engine.sequence import FinishReason, SamplingParams
from tristream.engine.speculative import SpecStats, SpeculativeConfig, propose_ngram

SYSTEM = "You are a helpful assistant. Answer clearly and briefly."

PARAGRAPH = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
             "Shop owners worried that fewer parking spaces would mean fewer customers, while cyclists "
             "said the lanes would make the street safer for children riding to school. After two hours "
             "the council agreed to build the lanes next spring and to review parking again in a year.")

TASKS: list[tuple[str, list[dict[str, str]]]] = [
    ("repeat_list", [{"role": "user", "content":
                      "Repeat this shopping list exactly, one item per line: milk, eggs, bread, butter, "
                      "apples, rice, coffee, tomatoes, cheese, orange juice."}]),
    ("read_back_order", [{"role": "user", "content":
                          "I'd like to order two large pepperoni pizzas, one garlic bread and a bottle "
                          "of lemonade, delivered to 14 Baker Street at seven o'clock. Please read my "
                          "order back to me."}]),
    ("read_back_phone", [{"role": "user", "content":
                          "My name is Anna Kowalski and my phone number is 555 0142 8876. Please "
                          "confirm my name and number."}]),
    ("summarise", [{"role": "user", "content": "Summarise this paragraph in two sentences:\n\n" + PARAGRAPH}]),
    ("rewrite_formal", [{"role": "user", "content":
                         "Rewrite this message so it sounds polite and formal: hey, the meeting got "
                         "moved to friday at 3, bring the sales report and the slides, thanks."}]),
    ("fix_code", [{"role": "user", "content":
                   "This Python function should add two numbers but it is wrong. Show the fixed "
                   "function.\n\ndef add_numbers(first_number, second_number):\n"
                   "    result = first_number - second_number\n    return result"}]),
    ("history_name", [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hi, I'm Tom and I live in Leeds. I have a dog called Biscuit."},
        {"role": "assistant", "content": "Nice to meet you, Tom! Biscuit sounds lovely. How can I help?"},
        {"role": "user", "content": "What is my name, where do I live and what is my dog called?"}]),
    ("history_recipe", [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How do I make a cup of tea?"},
        {"role": "assistant", "content": "Boil water, put a tea bag in a cup, pour the water over it, "
                                         "wait three minutes, remove the bag and add milk if you like."},
        {"role": "user", "content": "Can you list those steps again as a numbered list?"}]),
    ("everyday_question", [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What should I pack for a weekend camping trip?"}]),
    ("everyday_followup", [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is a good way to save money on groceries?"},
        {"role": "assistant", "content": "Plan your meals for the week, make a shopping list and stick "
                                         "to it, buy store brands, and avoid shopping when you are hungry."},
        {"role": "user", "content": "Which of those tips is the most important, and why?"}]),
]

DRAFTERS: dict[str, SpeculativeConfig] = {
    "n1-3_k4": SpeculativeConfig(max_ngram=3, min_ngram=1, max_draft=4),
    "n2-3_k4": SpeculativeConfig(max_ngram=3, min_ngram=2, max_draft=4),
    "n1-3_k8": SpeculativeConfig(max_ngram=3, min_ngram=1, max_draft=8),
    "n1-4_k2": SpeculativeConfig(max_ngram=4, min_ngram=1, max_draft=2),
}
ENGINE_SPEC = "n1-3_k4"
MODES = ("off", "on", "gated")  # plain decode; drafts always; drafts where they pay (row_cost from verify_cost)


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def steal_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (f[7] if len(f) > 7 else 0), sum(f)


def generate(eng: LLMEngine, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy answer tokens (EOS included when it ends the answer), its finish reason, and the
    time of the first token (prefill) and of the rest."""
    sid = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    toks: list[int] = []
    t0 = time.perf_counter()
    t_first = None
    reason = None
    while reason is None:
        for o in eng.step():
            if o.seq_id != sid:
                continue
            if o.token_id is not None:
                toks.append(o.token_id)
                if t_first is None:
                    t_first = time.perf_counter()
            if o.finished:
                reason = o.finish_reason
    t1 = time.perf_counter()
    assert t_first is not None
    return {"tokens": toks, "finish": reason.value if reason else None, "first_token_s": t_first - t0,
            "rest_s": t1 - t_first, "eos": reason is FinishReason.EOS}


def acceptance(prompt: list[int], answer: list[int], cfg: SpeculativeConfig) -> dict[str, Any]:
    """Drafts along a greedy answer and the target's verdict (read off the answer: exact for greedy)."""
    ctx_all = prompt + answer
    n = len(answer)
    drafted = accepted = positions_with_draft = 0
    per_pos: list[int] = []
    for t in range(n):
        d = propose_ngram(ctx_all[:len(prompt) + t], cfg.max_ngram, cfg.min_ngram, cfg.max_draft)
        a = 0
        while a < len(d) and t + a < n and d[a] == answer[t + a]:
            a += 1
        drafted += len(d)
        accepted += a
        positions_with_draft += bool(d)
        per_pos.append(a)
    # the engine's trajectory: verify at t, advance by accepted + 1
    t = forwards = verify_with_draft = traj_drafted = traj_accepted = 0
    while t < n:
        d = propose_ngram(ctx_all[:len(prompt) + t], cfg.max_ngram, cfg.min_ngram, min(cfg.max_draft, n - t - 1))
        a = 0
        while a < len(d) and d[a] == answer[t + a]:
            a += 1
        forwards += 1
        verify_with_draft += bool(d)
        traj_drafted += len(d)
        traj_accepted += a
        t += a + 1
    return {
        "answer_tokens": n,
        "every_position": {"positions": n, "with_draft": positions_with_draft, "drafted": drafted,
                           "accepted": accepted, "mean_draft_len": drafted / max(1, n),
                           "mean_accepted_len": accepted / max(1, n),
                           "acceptance_rate": accepted / drafted if drafted else None},
        "trajectory": {"target_forwards": forwards, "tokens_per_forward": n / max(1, forwards),
                       "verify_steps_with_draft": verify_with_draft, "drafted": traj_drafted,
                       "accepted": traj_accepted,
                       "mean_accepted_per_verify": traj_accepted / verify_with_draft if verify_with_draft else 0.0,
                       "acceptance_rate": traj_accepted / traj_drafted if traj_drafted else None},
    }


def sum_acceptance(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = sum(r["answer_tokens"] for r in rows)
    ep = {k: sum(r["every_position"][k] for r in rows) for k in ("positions", "with_draft", "drafted", "accepted")}
    tr = {k: sum(r["trajectory"][k] for r in rows)
          for k in ("target_forwards", "verify_steps_with_draft", "drafted", "accepted")}
    return {"answer_tokens": n,
            "every_position": {**ep, "mean_accepted_len": ep["accepted"] / max(1, n),
                               "mean_draft_len": ep["drafted"] / max(1, n),
                               "acceptance_rate": ep["accepted"] / ep["drafted"] if ep["drafted"] else None},
            "trajectory": {**tr, "tokens_per_forward": n / max(1, tr["target_forwards"]),
                           "mean_accepted_per_verify": tr["accepted"] / max(1, tr["verify_steps_with_draft"]),
                           "acceptance_rate": tr["accepted"] / tr["drafted"] if tr["drafted"] else None}}


def verify_cost(eng: LLMEngine, prompt: list[int], ks: tuple[int, ...], reps: int) -> dict[str, Any]:
    """Median ms of a plain decode step and of a verify forward of 1 + k positions, at the context
    of `prompt` (prefilled once; each timed forward rewrites the same slots past it)."""
    sid = eng.add_request(prompt, SamplingParams(max_tokens=1), generate=False)
    while eng.has_work():
        eng.step()
    seq = eng.seqs[sid]
    n0 = len(seq.keys)
    seq.num_computed = n0 - 1  # the last prompt token is "pending", as in decode
    eng._ensure_blocks(seq, n0 + max(ks), set())
    out: dict[str, Any] = {"context": n0}

    chunks = {k: PrefillChunk(seq, n0 - 1, 1 + k, True) for k in ks}
    ts: dict[str, list[float]] = {"decode": [], **{f"k{k}": [] for k in ks}}
    for _ in range(reps):  # interleaved, so load changes hit every shape alike
        t = time.perf_counter()
        eng.runner.decode([seq])
        ts["decode"].append((time.perf_counter() - t) * 1e3)
        for k in ks:
            seq.keys[n0:] = prompt[:k]  # any tokens: the cost does not depend on them
            t = time.perf_counter()
            eng.runner.verify([chunks[k]])
            ts[f"k{k}"].append((time.perf_counter() - t) * 1e3)
            del seq.keys[n0:]
    out["decode_ms"] = statistics.median(ts["decode"])
    for k in ks:
        out[f"verify_k{k}_ms"] = statistics.median(ts[f"k{k}"])
        out[f"verify_k{k}_over_decode"] = statistics.median(v / d for v, d in zip(ts[f"k{k}"], ts["decode"], strict=True))
    eng.close(sid)
    eng.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quants", default="int4", help="weight formats: int4 (the CPU default), none (fp32)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="engine timing rounds (on/off interleaved per task)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verify-reps", type=int, default=30)
    ap.add_argument("--out", default="spec_cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tristream.engine.cli_support import default_model_path

    path = default_model_path()
    st0 = steal_ticks()
    res: dict[str, Any] = {
        "model": path.name, "device": "cpu", "threads": args.threads, "max_tokens": args.max_tokens,
        "cpu": cpu_info(), "load_avg_start": os.getloadavg(),
        "shared_machine": "2 cores shared with other agents' work: absolute ms are noisy; ratios are from one run",
        "command": "python bench/spec.py " + " ".join(sys.argv[1:]),
        "drafters": {k: {"max_ngram": c.max_ngram, "min_ngram": c.min_ngram, "max_draft": c.max_draft}
                     for k, c in DRAFTERS.items()},
        "engine_drafter": ENGINE_SPEC, "quants": {},
    }
    for quant in args.quants.split(","):
        q = None if quant == "none" else quant
        t = time.perf_counter()
        plain = LLMEngine.from_path(path, quant=q, config=EngineConfig(max_model_len=2048))
        load_s = time.perf_counter() - t
        tok = plain.tokenizer
        assert tok is not None
        generate(plain, tok.apply_chat_template(TASKS[0][1]), 8)  # warm-up (kernels, first allocations)
        cost = verify_cost(plain, tok.apply_chat_template(TASKS[3][1]), (1, 2, 4, 8), args.verify_reps)
        log(quant, "verify cost", cost)
        row_cost = max(0.0, (cost["verify_k4_over_decode"] - 1) / 4)  # the gated engine's cost model
        gated_cfg = dataclasses.replace(DRAFTERS[ENGINE_SPEC], row_cost=row_cost)
        engines = {"off": plain}
        for mode, sc in (("on", DRAFTERS[ENGINE_SPEC]), ("gated", gated_cfg)):
            # the same weights, a cache of its own
            engines[mode] = LLMEngine(plain.model, plain.tokenizer, EngineConfig(max_model_len=2048, speculative=sc))
            generate(engines[mode], tok.apply_chat_template(TASKS[0][1]), 8)
        warm = {m: dataclasses.replace(engines[m].stats.spec) for m in MODES[1:]}
        qres: dict[str, Any] = {"load_s": load_s, "verify_cost": cost, "gated_row_cost": row_cost, "tasks": {}}
        acc_rows: dict[str, list[dict[str, Any]]] = {k: [] for k in DRAFTERS}
        times: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
        for name, chat in TASKS:
            prompt = tok.apply_chat_template(chat)
            row: dict[str, Any] = {"prompt_tokens": len(prompt)}
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for rnd in range(args.rounds):
                order = MODES if rnd % 2 == 0 else MODES[::-1]
                for mode in order:
                    runs[mode].append(generate(engines[mode], prompt, args.max_tokens))
            ref = runs["off"][0]
            answer = ref["tokens"]
            row["answer_text"] = tok.decode([t for t in answer if t not in plain.eos_ids])
            row["finish"] = ref["finish"]
            for k, cfg in DRAFTERS.items():
                a = acceptance(prompt, answer, cfg)
                row[k] = a
                acc_rows[k].append(a)
            row["engine"] = {"answer_tokens": len(answer)}
            e = row["engine"]
            for mode in MODES:
                e[f"{mode}_ms_per_token"] = [1e3 * r["rest_s"] / max(1, len(r["tokens"]) - 1) for r in runs[mode]]
                e[f"{mode}_first_token_ms"] = [1e3 * r["first_token_s"] for r in runs[mode]]
                times[mode].setdefault("rest_s", []).append(sum(r["rest_s"] for r in runs[mode]))
                times[mode].setdefault("tokens", []).append(sum(max(0, len(r["tokens"]) - 1) for r in runs[mode]))
                if mode != "off":
                    got = runs[mode][0]["tokens"]
                    same = next((i for i, (x, y) in enumerate(zip(answer, got, strict=False)) if x != y),
                                min(len(answer), len(got)))
                    e[f"{mode}_tokens_equal"] = got == answer
                    e[f"{mode}_first_difference"] = None if got == answer else same
                    e[f"{mode}_speedup_median"] = (statistics.median(e["off_ms_per_token"])
                                                   / statistics.median(e[f"{mode}_ms_per_token"]))
            qres["tasks"][name] = row
            log(f"{quant} {name}: {len(answer)} tokens, tokens/forward "
                f"{row[ENGINE_SPEC]['trajectory']['tokens_per_forward']:.2f}, equal "
                f"{e['on_tokens_equal']}/{e['gated_tokens_equal']}, ms/token "
                + " ".join(f"{m} {statistics.median(e[f'{m}_ms_per_token']):.2f}" for m in MODES))
        qres["acceptance"] = {k: sum_acceptance(v) for k, v in acc_rows.items()}
        ms = {m: 1e3 * sum(times[m]["rest_s"]) / sum(times[m]["tokens"]) for m in MODES}
        qres["engine"] = {"drafter": ENGINE_SPEC, "gated_row_cost": row_cost, "tasks": len(TASKS),
                          **{f"ms_per_token_{m}": ms[m] for m in MODES}}
        for m in MODES[1:]:
            s0 = engines[m].stats.spec
            s = SpecStats(*(getattr(s0, f.name) - getattr(warm[m], f.name) for f in dataclasses.fields(s0)))
            qres["engine"][m] = {
                "speedup": ms["off"] / ms[m],
                "tasks_tokens_equal": sum(r["engine"][f"{m}_tokens_equal"] for r in qres["tasks"].values()),
                "verify_steps": s.verify_steps, "draft_tokens": s.draft_tokens,
                "accepted_tokens": s.accepted_tokens, "emitted_tokens": s.emitted_tokens,
                "acceptance_rate": s.accepted_tokens / max(1, s.draft_tokens)}
        log(quant, "engine", qres["engine"])
        res["quants"][quant] = qres
    st1 = steal_ticks()
    res["load_avg_end"] = os.getloadavg()
    res["steal_share"] = (st1[0] - st0[0]) / max(1, st1[1] - st0[1])
    p = write_results(args.out, res)
    log("wrote", p)


if __name__ == "__main__":
    main()
