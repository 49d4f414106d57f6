"""Where the wall time of one streaming Whisper update goes: host phases vs GPU work vs GPU idle.

The per-update figure of `bench/encoders.py` (16 streams, 10 s buffers, 4-token tail) is the wall
time of `WhisperRunner.run_store`; its graphs alone add up to less. This wraps the runner's phases
(`_set_inputs`, the audio gather, each graph replay, the status reads, the final read) with host
clocks and CUDA events and reports, per phase, host time and GPU time, and the GPU's idle time
between phases (waiting for the host). Then the same for `StreamingWhisper.step()` in the
realistic loop (0.5 s chunks for 10 s per stream): the share of a step spent outside the pass.

    python3 bench/whisper_timeline.py [--streams 16] [--iters 30] [--name whisper_timeline]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import host_speed, write_results  # noqa: E402
from tristream.engine.speech.audio_store import AudioStore  # noqa: E402
from tristream.engine.speech.config import WhisperTokens, preset  # noqa: E402
from tristream.engine.speech.runner import WhisperRunner  # noqa: E402
from tristream.engine.speech.streaming import StreamingWhisper  # noqa: E402
from tristream.engine.speech.whisper import load_whisper  # noqa: E402


class Timeline:
    """Host clock + CUDA event around each wrapped call, in call order."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float, torch.cuda.Event, torch.cuda.Event]] = []
        self.on = False

    def wrap(self, obj: object, attr: str, label: Any) -> None:
        fn = getattr(obj, attr)

        def inner(*a: Any, **k: Any) -> Any:
            if not self.on:
                return fn(*a, **k)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            r = fn(*a, **k)
            e1.record()
            self.rows.append((label(*a) if callable(label) else label, t0, time.perf_counter(), e0, e1))
            return r

        setattr(obj, attr, inner)

    def summary(self, t_start: float, t_end: float) -> dict[str, Any]:
        """Per label: host ms (sum), GPU ms between its events (sum); GPU idle before each label."""
        torch.cuda.synchronize()
        host: dict[str, float] = defaultdict(float)
        gpu: dict[str, float] = defaultdict(float)
        idle_before: dict[str, float] = defaultdict(float)
        prev_end: torch.cuda.Event | None = None
        for label, h0, h1, e0, e1 in self.rows:
            host[label] += (h1 - h0) * 1e3
            gpu[label] += e0.elapsed_time(e1)
            if prev_end is not None:
                idle_before[label] += prev_end.elapsed_time(e0)
            prev_end = e1
        wall = (t_end - t_start) * 1e3
        first_h = self.rows[0][1] if self.rows else t_start
        return {"wall_ms": wall, "host_ms": dict(host), "gpu_ms": dict(gpu), "gpu_gap_before_ms": dict(idle_before),
                "host_before_first_call_ms": (first_h - t_start) * 1e3,
                "host_after_last_call_ms": (t_end - self.rows[-1][2]) * 1e3 if self.rows else 0.0}


def _median_dicts(ds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in ds[0].items():
        if isinstance(v, dict):
            keys = sorted({kk for d in ds for kk in d[k]})
            out[k] = {kk: round(statistics.median(d[k].get(kk, 0.0) for d in ds), 4) for kk in keys}
        else:
            out[k] = round(statistics.median(d[k] for d in ds), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--name", default="whisper_timeline")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/whisper_timeline.py needs a CUDA GPU")
    import transformers

    dev, dt, n, cap = torch.device("cuda"), torch.float16, args.streams, 32
    dims = preset(args.model)
    torch.manual_seed(dims.d_model * 1000 + dims.decoder_layers)  # the weights bench/encoders.py uses
    with torch.device(dev):
        hf = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**dims.to_hf())).eval()
    model = load_whisper(dims, hf.state_dict()).eval().to(dev, dt)
    del hf
    toks = WhisperTokens.for_vocab(dims.vocab_size)
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max(n, 1)) or (1,)
    runner = WhisperRunner(model, toks, batch_buckets=buckets, audio_buckets_s=(5.0, 10.0), max_new_tokens=cap,
                           chunk=4, early_stop=False, max_draft=cap - 1, word_times=True)
    runner.capture()
    tl = Timeline()
    tl.wrap(runner, "_set_inputs", "set_inputs")
    tl.wrap(runner, "_run", lambda kind, bb, ab: kind)
    tl.wrap(runner, "_read", "read")
    status_reads = [0]
    real_status = runner.status

    class _Status:  # count and time the status reads (`self.status.tolist()` in `_pass`)
        def tolist(self) -> Any:
            status_reads[0] += 1
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            r = real_status.tolist()
            e1.record()
            if tl.on:
                tl.rows.append(("status_read", t0, time.perf_counter(), e0, e1))
            return r

        def __getattr__(self, a: str) -> Any:
            return getattr(real_status, a)

        def __setitem__(self, k: Any, v: Any) -> None:
            real_status[k] = v

    rng = np.random.default_rng(0)
    store = AudioStore(n, 10 * 16000, dev)
    slots = [store.acquire() for _ in range(n)]
    for sl in slots:
        store.append(sl, (0.1 * rng.standard_normal(10 * 16000 - 1600)).astype(np.float32))
    first = runner.run_store(store, slots)
    drafts = [r[: cap - 4].tolist() for r in first.tokens]
    dfr = [f[: cap - 3].tolist() for f in first.frames]
    res: dict[str, Any] = {"model": args.model, "streams": n, "buffer_s": 10.0, "tail": 4,
                           "host_speed": host_speed()}
    runner.status = _Status()  # type: ignore[assignment]
    try:
        per_pass = []
        walls = []
        for i in range(args.iters + 3):
            torch.cuda.synchronize()
            tl.rows.clear()
            tl.on = i >= 3
            t0 = time.perf_counter()
            runner.run_store(store, slots, drafts, dfr)
            t1 = time.perf_counter()
            if tl.on:
                per_pass.append(tl.summary(t0, t1))
                walls.append((t1 - t0) * 1e3)
        res["pass_tail4"] = _median_dicts(per_pass)
        res["pass_tail4"]["status_reads_per_pass"] = status_reads[0] / max(1, args.iters + 3)
        # the same pass without the wrappers' events (their cost is in the figures above)
        tl.on = False
        plain = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.run_store(store, slots, drafts, dfr)
            plain.append((time.perf_counter() - t0) * 1e3)
        res["pass_tail4_unwrapped_wall_ms"] = round(statistics.median(plain), 4)
        print("pass (tail4):", res["pass_tail4"], "unwrapped", res["pass_tail4_unwrapped_wall_ms"], flush=True)

        # the realistic loop: time inside vs outside the runner's pass per step
        for align in ("commit", "every"):
            asr = StreamingWhisper(runner, lambda t: f" w{t % 97}", min_update_s=0.5, trim_after_s=9.5, align=align)
            for i in range(n):
                asr.open(f"s{i}", 0)
            audio = (0.1 * np.random.default_rng(n).standard_normal(10 * 16000)).astype(np.float32)
            steps = []
            for k in range(0, audio.size, 8000):
                for i in range(n):
                    asr.push(f"s{i}", audio[k : k + 8000])
                torch.cuda.synchronize()
                tl.rows.clear()
                tl.on = True
                t0 = time.perf_counter()
                asr.step()
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                tl.on = False
                s = tl.summary(t0, t1)
                inside = sum(h1 - h0 for _, h0, h1, _, _ in tl.rows) * 1e3
                s["host_outside_runner_calls_ms"] = s["wall_ms"] - inside
                steps.append(s)
            res[f"loop_{align}"] = _median_dicts(steps)
            res[f"loop_{align}"]["walls_ms"] = [round(s["wall_ms"], 3) for s in steps]
            print(f"loop {align}:", res[f"loop_{align}"], flush=True)
    finally:
        runner.status = real_status
    path = write_results(args.name, res)
    print("wrote", path)


if __name__ == "__main__":
    main()
