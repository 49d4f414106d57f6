"""Answers of the CPU defaults on the AVX2 path: `generate`, `chat`, `serve` and `demo`.

Every command runs as a user would run it, with its defaults (int4 weights, the embedded
SmolLM2), in a process whose torch, oneDNN and our kernels are held to AVX2
(``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 TRISTREAM_CPU_ISA=avx2``), as on a CPU
without AVX-512. The questions and accepted answers are `bench/assistant.py`'s:

- generate: one process per question (`tristream generate "Q"`), no history;
- chat: all questions in one `tristream chat` session on stdin (history in the prompt);
- serve: `bench/assistant.py` against `tristream serve --token T` (text turns, one session);
- demo: `tristream demo` on its bundled input: completes, and its transcript and answers are kept.

    .venv/bin/python bench/cpu_answers.py [--native] [--n 24]

Writes bench/results/cpu_answers.json (cpu_answers_native.json with --native).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import cpu_info, write_results  # noqa: E402
from bench.assistant import QUESTIONS  # noqa: E402

FORCED_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "TRISTREAM_CPU_ISA": "avx2"}
CLI = [sys.executable, "-m", "tristream.cli"]


def correct(q: tuple[str, ...], answer: str) -> bool:
    good = re.search(q[1], answer, re.I) is not None
    bad = len(q) > 2 and re.search(q[2], answer, re.I) is not None
    return good and not bad


def run_generate(env: dict[str, str], qs: list[tuple[str, ...]]) -> dict[str, Any]:
    """Each question in its own `tristream generate`, and again with dense float32 weights on the
    CPU's own instruction set: the int4 answer should be the dense model's, word for word."""
    rows = []
    for q in qs:
        t = time.perf_counter()
        p = subprocess.run([*CLI, "generate", q[0]], capture_output=True, text=True, env=env, timeout=300)
        ans = p.stdout.strip()
        dense = subprocess.run([*CLI, "generate", q[0], "--quant", "none"], capture_output=True, text=True,
                               timeout=300).stdout.strip()
        rows.append({"q": q[0], "answer": ans, "ok": p.returncode == 0 and correct(q, ans), "dense_answer": dense,
                     "same_as_dense": ans == dense, "dense_ok": correct(q, dense),
                     "rc": p.returncode, "s": time.perf_counter() - t, "stderr": p.stderr[-300:] if p.returncode else ""})
    return {"correct": sum(r["ok"] for r in rows), "asked": len(rows),
            "same_as_dense": sum(r["same_as_dense"] for r in rows), "dense_correct": sum(r["dense_ok"] for r in rows),
            "rows": rows}


def run_chat(env: dict[str, str], qs: list[tuple[str, ...]]) -> dict[str, Any]:
    p = subprocess.run([*CLI, "chat"], input="\n".join(q[0] for q in qs) + "\n", capture_output=True,
                       text=True, env=env, timeout=1800)
    parts = p.stdout.split("> ")[1:]  # one part per question: the streamed answer up to the next prompt
    rows = []
    for i, q in enumerate(qs):
        ans = parts[i].strip() if i < len(parts) else ""
        rows.append({"q": q[0], "answer": ans, "ok": correct(q, ans)})
    return {"correct": sum(r["ok"] for r in rows), "asked": len(rows), "rc": p.returncode, "rows": rows,
            "stderr": p.stderr[-300:] if p.returncode else ""}


def run_serve(env: dict[str, str], out: Path) -> dict[str, Any]:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "assistant.py"), "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=2400)
    if p.returncode != 0 or not out.exists():
        return {"error": (p.stderr or p.stdout)[-600:]}
    res = json.loads(out.read_text())
    out.unlink()
    return {"summary": {k: v for k, v in res.get("results", res).items() if not isinstance(v, list | dict)},
            "tail": p.stdout.strip().splitlines()[-6:]}


def run_demo(env: dict[str, str], tmp: Path) -> dict[str, Any]:
    t = time.perf_counter()
    p = subprocess.run([*CLI, "demo", "--out", str(tmp / "demo_answers.wav")], capture_output=True, text=True,
                       env=env, timeout=900)
    return {"rc": p.returncode, "s": time.perf_counter() - t, "stdout": p.stdout.strip().splitlines()[-40:],
            "stderr": p.stderr[-400:] if p.returncode else ""}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--native", action="store_true", help="the CPU's own instruction set instead of AVX2")
    ap.add_argument("--n", type=int, default=24, help="questions for generate and chat")
    ap.add_argument("--skip", default="", help="comma list of generate,chat,serve,demo to leave out")
    args = ap.parse_args()
    env = {**os.environ, **({} if args.native else FORCED_AVX2)}
    qs = QUESTIONS[:args.n]
    skip = set(filter(None, args.skip.split(",")))
    res: dict[str, Any] = {"path": "native" if args.native else "avx2 forced", "env": {} if args.native else FORCED_AVX2,
                           "cpu": cpu_info()}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("generate", lambda: run_generate(env, qs)), ("chat", lambda: run_chat(env, qs)),
                         ("serve", lambda: run_serve(env, Path(tmp) / "assistant.json")),
                         ("demo", lambda: run_demo(env, Path(tmp)))):
            if name in skip:
                continue
            t = time.perf_counter()
            res[name] = fn()
            res[name]["wall_s"] = time.perf_counter() - t
            r = res[name]
            print(name, {k: v for k, v in r.items() if k in ("correct", "asked", "same_as_dense", "dense_correct", "rc", "summary", "error", "wall_s")},
                  flush=True)
    path = write_results("cpu_answers_native" if args.native else "cpu_answers", res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
