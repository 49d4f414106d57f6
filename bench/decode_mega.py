"""Batch-1 decode step: the persistent megakernel (`tristream/engine/kernels/decode_mega.py`) against
the production decode graphs (GPU only).

For SmolLM2-135M and Llama-3.2-1B configs with random bf16 weights and a 128-token context (random
K/V in a paged cache, a shuffled block table), ms per step of a CUDA graph replay of:

* `cublas`  — `DecodeGraphs` cuBLAS path (cuBLAS GEMMs + fused norms, Triton attention);
* `b1_pdl`  — `DecodeGraphs`' batch-1 fused variant with Programmatic Dependent Launch (`b1` below sm90);
* `mega_phases` — the megakernel's phases, one launch each (5 per layer + 1: the fallback);
* `mega_<spin>` — the persistent single launch, per grid-barrier spin mode (`SPIN_MODES`), and
  `mega_<first spin>_split<S>` with attention split over S programs per q head,

with each one's logits relative error against `cublas` and whether the greedy token agrees, plus the
persistent kernel's registers / spills / programs and, from one launch with timestamps, the µs
per phase kind (mean over layers) as program 0 saw them (work + wait for the slowest + barrier). Every model runs in a child process with a
timeout: a wrong grid barrier hangs the GPU kernel, and that must show up as "hang at <stage>",
not as a stuck device. Writes bench/results/decode_mega.json (and a copy to $OUT when set).

    python bench/decode_mega.py [--models smollm2-135m,llama-3.2-1b] [--spins atomic,volatile]
                                [--timeout 150] [--stage-timeout 40]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench._common import cuda_graph_ms, write_results  # noqa: E402

CTX = 128  # tokens already in the cache; the step decodes position CTX
BLOCK = 16


def emit(kind: str, payload: Any) -> None:
    """One line the parent parses: STAGE <name> before each risky step, RESULT <json> after it."""
    print(f"{kind} {json.dumps(payload) if not isinstance(payload, str) else payload}", flush=True)


def _graph(fn: Any) -> torch.cuda.CUDAGraph:
    fn()  # compile / warm outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def child(name: str, spins: list[str]) -> None:
    """Run every variant of one model, printing STAGE/RESULT lines as it goes."""
    from bench.llm import random_model
    from tristream.engine.graphs import DecodeGraphs
    from tristream.engine.kernels.decode_mega import MegaDecoder
    from tristream.engine.kv_cache import KVCache

    torch.manual_seed(0)
    emit("STAGE", f"{name} build")
    model = random_model(name)
    cfg = model.cfg
    cache = KVCache(cfg, 4 * (CTX // BLOCK + 2), BLOCK, model.dtype, device="cuda")
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    dec = DecodeGraphs(model, cache, max_model_len=4096, buckets=(1,), kernels="cublas")
    table = torch.randperm(cache.num_blocks)[: CTX // BLOCK + 1].to(torch.int32)
    dec.ids[0] = 4321 % cfg.vocab_size
    dec.positions[0] = CTX
    dec.slots[0] = int(table[CTX // BLOCK]) * BLOCK + CTX % BLOCK
    dec.ctx_lens[0] = CTX + 1
    dec.block_tables[0, : table.numel()] = table.to(dec.block_tables.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    emit("RESULT", {"model": name, "weight_bytes": weight_bytes, "num_sms": dec.num_sms})
    inp = {"ids": dec.ids[:1], "positions": dec.positions[:1], "slots": dec.slots[:1],
           "block_tables": dec.block_tables[:1], "ctx_lens": dec.ctx_lens[:1]}
    with torch.inference_mode():
        ref = dec.forward(1, "cublas").clone()
        b1 = "b1_pdl" if torch.cuda.get_device_capability()[0] >= 9 else "b1"
        for v in ("cublas", b1):
            emit("STAGE", f"{name} {v}")
            got = dec.forward(1, v).clone()
            ms = cuda_graph_ms(_graph(lambda v=v: dec.forward(1, v)))
            emit("RESULT", {"variant": v, "ms": round(ms, 4), "rel_err_vs_cublas": _rel(got, ref),
                            "greedy_same": int(got.argmax()) == int(ref.argmax())})
        emit("STAGE", f"{name} mega_phases")
        phased = MegaDecoder(model, cache)
        ph = phased(**inp, persistent=False).clone()
        ms = cuda_graph_ms(_graph(lambda: phased(**inp, persistent=False)))
        emit("RESULT", {"variant": "mega_phases", "ms": round(ms, 4), "rel_err_vs_cublas": _rel(ph, ref),
                        "greedy_same": int(ph.argmax()) == int(ref.argmax()), "tiles": phased.consts})
        # attention split: about one program per (q head, split) over the SMs
        auto_splits = max(1, min(16, 1 << max(0, (dec.num_sms // cfg.num_heads).bit_length() - 1)))
        runs = [(f"mega_{spin}", spin, 1) for spin in spins]
        if spins and auto_splits > 1:
            runs.append((f"mega_{spins[0]}_split{auto_splits}", spins[0], auto_splits))
        for label, spin, splits in runs:
            emit("STAGE", f"{name} {label} first launch")
            mega = MegaDecoder(model, cache, spin=spin, attn_splits=splits)
            t0 = time.perf_counter()
            got = mega(**inp).clone()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            emit("STAGE", f"{name} {label} graph replays")
            ms = cuda_graph_ms(_graph(lambda mega=mega: mega(**inp)))
            again = mega.logits.clone()
            emit("RESULT", {"variant": label, "ms": round(ms, 4), "rel_err_vs_cublas": _rel(got, ref),
                            "greedy_same": int(got.argmax()) == int(ref.argmax()),
                            "equal_to_phases": bool(torch.equal(got, ph)), "rel_err_vs_phases": _rel(got, ph), "replays_equal": bool(torch.equal(again, got)),
                            "counters_after": mega.counters.tolist(), "first_call_s_incl_compile": round(first_s, 2),
                            "kernel": mega.kernel_info})
        if spins:  # where the persistent launch spends its time, as program 0 sees it
            emit("STAGE", f"{name} mega_{spins[0]} timestamps")
            stamped = MegaDecoder(model, cache, spin=spins[0], timestamps=True)
            for _ in range(3):
                stamped(**inp)
            torch.cuda.synchronize()
            emit("RESULT", {"phase_us": stamped.phase_times_us(), "phase_us_spin": spins[0]})
    emit("STAGE", f"{name} done")


def run_child(name: str, spins: list[str], timeout: float, stage_timeout: float,
              cmd: list[str] | None = None) -> dict[str, Any]:
    """One model in a subprocess, its STAGE/RESULT lines read as they come. The child is killed when
    the whole run passes `timeout` or a persistent-kernel stage passes `stage_timeout` (a barrier that
    never opens), and that is reported as a hang at the last stage it announced."""
    cmd = cmd or [sys.executable, str(Path(__file__).resolve()), "--child", name, "--spins", ",".join(spins)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    err: list[str] = []

    def pump_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def pump_err() -> None:
        assert proc.stderr is not None
        err.extend(proc.stderr)

    threading.Thread(target=pump_out, daemon=True).start()
    threading.Thread(target=pump_err, daemon=True).start()
    res: dict[str, Any] = {"variants": {}}
    stage, stage_end, hang = None, float("inf"), None
    while True:
        now = time.perf_counter()
        left = min(t0 + timeout, stage_end) - now
        if left <= 0:
            hang = f"killed after {now - t0:.0f} s in stage {stage!r} (no progress: a grid barrier that never opened?)"
            proc.kill()
            break
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        if line is None:
            break
        if line.startswith("STAGE "):
            stage = line[6:]
            stage_end = now + stage_timeout if "mega_" in stage and "phases" not in stage else float("inf")
        elif line.startswith("RESULT "):
            r = json.loads(line[7:])
            if "variant" in r:
                res["variants"][r.pop("variant")] = r
            else:
                res.update(r)
    rc = proc.wait()
    res.update(wall_s=round(time.perf_counter() - t0, 1), returncode=rc)
    if hang is not None:
        res["hang"] = hang
    elif rc != 0:
        res["error"] = f"exit {rc} in stage {stage!r}: {''.join(err).strip()[-1500:]}"
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--spins", default="atomic,volatile")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per model (child process)")
    ap.add_argument("--stage-timeout", type=float, default=40.0,
                    help="seconds for one persistent-kernel stage (compile included) before it counts as a hang")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    spins = [s for s in args.spins.split(",") if s]
    if args.child:
        child(args.child, spins)
        return
    if not torch.cuda.is_available():
        raise SystemExit("decode_mega.py needs a CUDA GPU (the persistent kernel's grid barrier)")
    results: dict[str, Any] = {"context_tokens": CTX, "block_size": BLOCK, "models": {}}
    for name in [m for m in args.models.split(",") if m]:
        r = run_child(name, spins, args.timeout, args.stage_timeout)
        results["models"][name] = r
        for v, x in r["variants"].items():
            print(f"{name:14s} {v:16s} {x.get('ms', float('nan')):8.4f} ms  err {x.get('rel_err_vs_cublas', 0):.2e}"
                  f"  greedy_same={x.get('greedy_same')}", flush=True)
        if "phase_us" in r:
            print(f"{name:14s} persistent phases (us, program 0): {r['phase_us']}", flush=True)
        for k in ("hang", "error"):
            if k in r:
                print(f"{name}: {k.upper()}: {r[k]}", flush=True)
    path = write_results("decode_mega", results)
    print(f"wrote {path}")
    out = os.environ.get("OUT")
    if out:
        shutil.copy(path, Path(out) / path.name)


if __name__ == "__main__":
    main()
