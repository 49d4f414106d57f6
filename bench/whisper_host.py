"""Host-side cost of one streaming-Whisper update (CPU): DTW token times and words, before vs after.

Run through `python bench/encoders.py --host-only` (writes `bench/results/encoders_whisper_host_cpu.json`).
Realistic sizes for Whisper-tiny at 16 streams: 10 s buffers (500 encoder frames), 32-token
hypotheses (`--capacity`), end-of-text at 24–31 tokens, the previous hypothesis accepted up to its
last 4 tokens (the steady "tail4" case), `retime` 4. "before" is `timing.py` as of `--before-rev`
(loaded from git), "after" is the working tree; both run in the same process on the same inputs,
and their frames must be identical.
"""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent


def load_rev(rev: str, path: str = "tristream/engine/speech/timing.py") -> ModuleType:
    """A module loaded from `path` as of git revision `rev`."""
    src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    f = Path(tempfile.mkdtemp()) / "timing_before.py"
    f.write_text(src)
    spec = importlib.util.spec_from_file_location("timing_before", f)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["timing_before"] = mod
    spec.loader.exec_module(mod)
    return mod


def time_us(fn: Callable[[], object], iters: int) -> dict[str, float]:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    ts.sort()
    return {"median_us": round(statistics.median(ts), 1), "p90_us": round(ts[int(0.9 * (len(ts) - 1))], 1),
            "iters": iters}


def inputs(streams: int, capacity: int, frames: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    eot = 50257
    k = capacity
    toks = rng.integers(220, 50000, (streams, k))
    n_text = rng.integers(k - 8, k + 1, streams)
    for i, n in enumerate(n_text):
        if n < k:
            toks[i, n:] = eot
    valid = np.full(streams, frames, np.int64)
    accepted = np.maximum(0, np.minimum(n_text, k) - 4)
    draft_frames = [sorted(rng.integers(0, frames - 20, int(a) + 1).tolist()) for a in accepted]
    align = torch.randn(streams, k + 1, frames)
    voiced = np.zeros((streams, frames), bool)  # speech-like: 160-480 ms voiced, 40-300 ms pauses
    for i in range(streams):
        f = 0
        while f < frames:
            w = int(rng.integers(8, 24))
            voiced[i, f:f + w] = True
            f += w + int(rng.integers(2, 15))
    return dict(toks=toks, eot=eot, valid=valid, accepted=accepted, draft_frames=draft_frames, align=align,
                voiced=voiced)


def bench_host(before_rev: str, streams: int = 16, capacity: int = 32, frames: int = 500, iters: int = 300
               ) -> dict[str, Any]:
    from tristream.engine.speech import timing as after
    from tristream.engine.speech.streaming import tokens_to_words

    before = load_rev(before_rev)
    x = inputs(streams, capacity, frames)
    res: dict[str, Any] = {"streams": streams, "capacity_tokens": capacity, "frames": frames, "retime": 4,
                           "before_rev": before_rev}

    def anchored(mod: ModuleType) -> Callable[[], np.ndarray]:
        return lambda: mod.anchored_token_starts(x["align"], x["toks"], x["eot"], x["valid"], x["accepted"],
                                                 x["draft_frames"], 4)

    same = bool((anchored(before)() == anchored(after)()).all())
    mat = x["align"].numpy()
    sub = np.ascontiguousarray(mat[:, capacity - 8:, frames // 2:])
    full_rows, full_frames = np.full(streams, capacity + 1), np.full(streams, frames)
    sub_rows, sub_frames = np.full(streams, 9), np.full(streams, frames - frames // 2)
    same &= bool((before.dtw_token_starts(mat, full_rows, full_frames)
                  == after.dtw_token_starts(mat, full_rows, full_frames)).all())
    same &= bool((before.dtw_token_starts(sub, sub_rows, sub_frames)
                  == after.dtw_token_starts(sub, sub_rows, sub_frames)).all())
    res["identical_frames"] = same
    for label, mod in (("before", before), ("after", after)):
        res[label] = {
            "anchored_token_starts_tail4": time_us(anchored(mod), iters),
            "dtw_all_rows": time_us(lambda m=mod: m.dtw_token_starts(mat, full_rows, full_frames), iters),
            "dtw_anchored_9rows": time_us(lambda m=mod: m.dtw_token_starts(sub, sub_rows, sub_frames), iters),
        }
    frames_tt = anchored(after)()
    pieces = [" w", "ord", " x"] * 20
    def to_words() -> None:
        for i in range(streams):
            tokens_to_words(x["toks"][i].tolist(), frames_tt[i].tolist(), lambda t: pieces[t % 60], x["eot"], 0,
                            frames, x["voiced"][i])

    res["tokens_to_words_snapped_all_streams_after"] = time_us(to_words, iters)
    return res


def print_host(r: dict[str, Any]) -> None:
    print(f"\nHost work per update, {r['streams']} streams, {r['capacity_tokens']} tokens, {r['frames']} frames "
          f"(median µs; identical frames: {r['identical_frames']})")
    print(f"{'part':>30} {'before':>9} {'after':>9} {'speedup':>8}")
    for k in r["after"]:
        b, a = r["before"][k]["median_us"], r["after"][k]["median_us"]
        print(f"{k:>30} {b:>9.1f} {a:>9.1f} {b / a:>7.2f}x")
    print(f"{'tokens_to_words (snapped), after':>30} {r['tokens_to_words_snapped_all_streams_after']['median_us']:>19.1f}")
