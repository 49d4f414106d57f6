"""Host-side cost of one streaming-Whisper update (CPU): DTW token times and words, before vs after.

Run through `python bench/encoders.py --host-only` (writes `bench/results/encoders_whisper_host_cpu.json`).
Realistic sizes for Whisper-tiny at 16 streams: 10 s buffers (500 encoder frames), 32-token
hypotheses (`--capacity`), end-of-text at 24–31 tokens, the previous hypothesis accepted up to its
last 4 tokens (the steady "tail4" case), `retime` 4. "before" is `timing.py` as of `--before-rev`
(loaded from git), "after" is the working tree; both run in the same process on the same inputs,
and their frames must be identical.
"""

from __future__ import annotations

import hashlib
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

from bench._common import call_times

ROOT = Path(__file__).resolve().parent.parent


def load_rev(rev: str, path: str = "tristream/speech/timing.py") -> ModuleType:
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
    """Thread CPU time per call (µs): this box is shared, wall time would count other processes."""
    ts = sorted(t * 1e6 for t in call_times(fn, iters, warm=3, clock=time.thread_time))
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
    from tristream.speech import timing as after
    from tristream.speech.streaming import tokens_to_words

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
    spans = []
    for i in range(streams):  # word spans as tokens_to_words builds them, before snapping
        ws = tokens_to_words(x["toks"][i].tolist(), frames_tt[i].tolist(), lambda t: pieces[t % 60], x["eot"], 0,
                             frames)
        spans.append([(w.start_ns // 20_000_000, w.end_ns // 20_000_000) for w in ws])
    res["words_per_stream"] = round(float(np.mean([len(sp) for sp in spans])), 1)
    res["identical_frames"] &= all(before.snap_words(sp, x["voiced"][i]) == after.snap_words(sp, x["voiced"][i])
                                   for i, sp in enumerate(spans))
    for label, mod in (("before", before), ("after", after)):
        res[label]["snap_words_all_streams"] = time_us(
            lambda m=mod: [m.snap_words(sp, x["voiced"][i]) for i, sp in enumerate(spans)], iters)
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


class _HostOnlyRunner:
    """Runner stand-in whose GPU work takes no time: it hears a scripted transcript per stream
    (words at true times, the newest word flickering as the buffer grows), and pays the real host
    cost of word times: `anchored_token_starts` over a [rows, K + 1, T] matrix for every timed row."""

    def __init__(self, words: dict[str, list[tuple[int, int]]], capacity: int, frames: int,
                 speech_mask: bool = False) -> None:
        from tristream.speech.config import WhisperTokens
        from tristream.speech.pass_io import RunnerStats

        self.words, self.k, self.frames = words, capacity, frames
        self.speech_mask = speech_mask  # voiced = inside a scripted word (pauses snap edges); else all voiced
        self.cpu_s = 0.0  # thread CPU spent in this stand-in (not part of the real path's host work)
        self.tokens = WhisperTokens.for_vocab(51865)
        self.max_draft, self.word_times = capacity - 1, True
        self.batch_buckets, self.audio_buckets, self.device = (1, 2, 4, 8, 16), (10.0,), "cpu"
        self.stats = RunnerStats()
        self.asr: Any = None
        self.align = torch.randn(16, capacity + 1, frames)
        self.last: tuple[np.ndarray, np.ndarray, np.ndarray, list[int]] | None = None

    def _hear(self, slot: int) -> tuple[list[int], list[int], int]:
        sid, s = next((k, v) for k, v in self.asr.streams.items() if v.slot == slot)
        t0, end = s.t0_ns, s.t0_ns + s.length * 1_000_000_000 // 16000
        heard = [(i, a, b) for i, (a, b) in enumerate(self.words[sid]) if t0 + 40_000_000 < b <= end]
        toks = [1000 + i for i, _, _ in heard][-self.k:]
        fr = [max(0, (a - t0) // 20_000_000) for _, a, _ in heard][-self.k:]
        if toks and (s.length // 8000) % 2:
            toks[-1] += 500
        tail = max(0, (heard[-1][2] - t0) // 20_000_000) if heard else 0
        return toks, fr + [tail], -(-s.length // 320)

    def _dtw(self, toks: np.ndarray, acc: np.ndarray, valid: list[int], dfr: Any) -> None:
        from tristream.speech.timing import anchored_token_starts

        anchored_token_starts(self.align, toks, self.tokens.eot, np.asarray(valid), acc, dfr, 4)

    def _mask(self, slots: list[int]) -> np.ndarray:
        if not self.speech_mask:
            return np.ones((len(slots), self.frames), bool)
        out = np.zeros((len(slots), self.frames), bool)
        for r, slot in enumerate(slots):
            sid, s = next((k, v) for k, v in self.asr.streams.items() if v.slot == slot)
            for a, b in self.words[sid]:
                lo, hi = (a - s.t0_ns) // 20_000_000, (b - s.t0_ns) // 20_000_000
                if hi > 0 and lo < self.frames:
                    out[r, max(lo, 0):hi] = True
        return out

    def run_store(self, store: Any, slots: list[int], drafts: Any = None, draft_frames: Any = None,
                  word_times: bool | None = None) -> Any:
        t = time.thread_time()
        try:
            return self._run_store(slots, drafts, draft_frames, word_times)
        finally:
            self.cpu_s += time.thread_time() - t

    def _run_store(self, slots: list[int], drafts: Any, draft_frames: Any, word_times: bool | None) -> Any:
        from tristream.speech.pass_io import PassResult

        self.slots = slots
        n, eot = len(slots), self.tokens.eot
        toks = np.full((n, self.k), eot, np.int64)
        frames = np.zeros((n, self.k + 1), np.int64)
        acc = np.zeros(n, np.int64)
        valid = []
        for r, slot in enumerate(slots):
            t, f, v = self._hear(slot)
            valid.append(v)
            toks[r, :len(t)], frames[r, :len(f)], frames[r, len(f):] = t, f, f[-1]
            d = list(drafts[r]) if drafts is not None else []
            while acc[r] < min(len(d), len(t)) and d[acc[r]] == t[acc[r]]:
                acc[r] += 1
        self.last = (toks, frames, acc, valid)
        timed = word_times is not False
        if timed:
            self._dtw(toks, acc, valid, draft_frames)
            self.stats.aligned_rows += n
        return PassResult(toks, frames if timed else np.zeros_like(frames), 10.0, n, acc, 0,
                          self._mask(slots) if timed else None)

    def align_rows(self, rows: list[int], draft_frames: Any = None) -> tuple[np.ndarray, np.ndarray]:
        t = time.thread_time()
        assert self.last is not None
        toks, frames, acc, valid = self.last
        self._dtw(toks[rows], acc[rows], [valid[r] for r in rows], draft_frames)
        self.stats.aligned_rows += len(rows)
        out = frames[rows], self._mask([self.slots[r] for r in rows])
        self.cpu_s += time.thread_time() - t
        return out


def bench_policies(streams: int = 16, seconds: float = 20.0, capacity: int = 32, rounds: int = 3,
                   speech_mask: bool = False) -> dict[str, Any]:
    """Host time per 16-stream `StreamingWhisper.step()` (GPU work = 0), aligning every update vs only
    updates that commit; scripted speech (words 180-420 ms, pauses 20-400 ms), 0.5 s updates.

    `median_step_cpu_ms` counts the whole step, the stand-in runner included (its host DTW, its
    scripted hearing); `median_step_host_ms` leaves the runner's calls out: what the real path pays
    on the host besides the runner. `speech_mask`: voiced only inside scripted words (edges snap onto
    the pauses), else every frame voiced."""
    from tristream.speech.streaming import StreamingWhisper

    rng = np.random.default_rng(0)
    script: dict[str, list[tuple[int, int]]] = {}
    for i in range(streams):
        t, out = int(rng.integers(50, 300)) * 1_000_000, []
        while t < seconds * 1e9:
            d = int(rng.integers(180, 420)) * 1_000_000
            out.append((t, t + d))
            t += d + int(rng.integers(20, 400)) * 1_000_000
        script[f"s{i}"] = out
    res: dict[str, Any] = {"streams": streams, "audio_s": seconds, "update_s": 0.5, "trim_after_s": 9.5,
                           "speech_mask": speech_mask,
                           "clock": f"thread CPU time (time.thread_time) per step, steps 4+, {rounds} alternating rounds"}
    cpu: dict[str, list[float]] = {"every": [], "commit": []}
    host: dict[str, list[float]] = {"every": [], "commit": []}
    for align in ("every", "commit") * rounds:
        r = _HostOnlyRunner(script, capacity, 500, speech_mask)
        asr = StreamingWhisper(r, lambda t: f" w{t}", min_update_s=0.5, trim_after_s=9.5, keep_s=2.0,  # type: ignore[arg-type]
                               max_streams=streams, align=align)
        r.asr = asr
        for sid in script:
            asr.open(sid, 0)
        ms, hs, words, texts = [], [], 0, []
        silence = np.zeros(8000, np.float32)
        for _ in range(int(seconds * 2)):
            for sid in script:
                asr.push(sid, silence)
            r.cpu_s = 0.0
            t = time.thread_time()
            ev = asr.step()
            d = time.thread_time() - t
            ms.append(d * 1e3)
            hs.append((d - r.cpu_s) * 1e3)
            words += sum(len(e.committed) for e in ev)
            texts += [(e.stream_id, w.text, w.start_ns, w.end_ns) for e in ev for w in e.committed + e.partial]
        cpu[align] += ms[4:]
        host[align] += hs[4:]
        res[align] = {"words_committed": words, "stream_updates_aligned": asr.stats.aligned,
                      "stream_updates_without_alignment": asr.stats.unaligned, "aligned_rows": r.stats.aligned_rows,
                      "events_digest": hashlib.sha256(repr(texts).encode()).hexdigest()[:16]}
    for align, v in cpu.items():
        res[align].update(median_step_cpu_ms=round(statistics.median(v), 3), mean_step_cpu_ms=round(statistics.mean(v), 3),
                          median_step_host_ms=round(statistics.median(host[align]), 3),
                          mean_step_host_ms=round(statistics.mean(host[align]), 3))
    return res


def bench_set_inputs(streams: int = 16, capacity: int = 32, iters: int = 2000) -> dict[str, Any]:
    """`WhisperRunner._set_inputs` host time (median µs of thread CPU) for one 16-stream pass: drafts of
    20-29 tokens (`max_draft` = capacity - 1), their frames, store slots; on a CPU runner (a small
    random model: the table's size depends only on `max_draft`), so no pinned copy or CUDA event."""
    from tristream.speech.config import WhisperDims, WhisperTokens
    from tristream.speech.runner import WhisperRunner
    from tristream.speech.whisper import Whisper

    dims = WhisperDims(d_model=64, encoder_layers=1, decoder_layers=1, heads=4, ffn=128, max_source_positions=250,
                       max_target_positions=64)
    r = WhisperRunner(Whisper(dims), WhisperTokens.for_vocab(dims.vocab_size), batch_buckets=(streams,),
                      audio_buckets_s=(5.0,), max_new_tokens=capacity, max_draft=capacity - 1, chunk=4)
    r.device_times = True  # only a flag here: the draft frames go into the table as on a GPU
    rng = np.random.default_rng(0)
    drafts = [rng.integers(220, 50000, int(rng.integers(20, 30))).tolist() for _ in range(streams)]
    frames = [sorted(rng.integers(0, 240, len(d) + 1).tolist()) for d in drafts]
    lengths, slots = [80000] * streams, list(range(streams))
    out = {"streams": streams, "max_draft": capacity - 1, "iters": iters}
    out["with_drafts_and_frames"] = time_us(lambda: r._set_inputs(lengths, streams, drafts, slots, frames), iters)
    out["table_digest"] = hashlib.sha256(r.pass_in.host.numpy().tobytes()).hexdigest()[:16]  # the table it wrote
    out["without_drafts"] = time_us(lambda: r._set_inputs(lengths, streams, None, slots, None), iters)
    return out


def compare_policies(before_rev: str, rounds: int = 5) -> dict[str, Any]:
    """`bench_policies` for the `tristream` package as of `before_rev` (from `git archive`) and for the
    working tree, in alternating subprocesses on this machine (same harness, this file); both masks."""
    import json
    import os

    tmp = Path(tempfile.mkdtemp())
    archive = subprocess.run(["git", "archive", before_rev, "tristream"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
            "from bench.whisper_host import bench_policies, bench_set_inputs; print(json.dumps([bench_policies(rounds=1), "
            "bench_policies(rounds=1, speech_mask=True), bench_set_inputs()]))")
    runs: dict[str, list[Any]] = {"before": [], "after": []}
    for _ in range(rounds):
        for label, path in (("before", str(tmp)), ("after", str(ROOT))):
            out = subprocess.run([sys.executable, "-c", code, path, str(ROOT)], capture_output=True, text=True,
                                 check=True, env={**os.environ, "PYTHONHASHSEED": "0"}).stdout
            runs[label].append(json.loads(out.strip().splitlines()[-1]))
    res: dict[str, Any] = {"before_rev": before_rev, "rounds": rounds}
    for label, rs in runs.items():
        res[label] = {}
        for m, mask in enumerate(("all_voiced", "speech_mask")):
            cell: dict[str, Any] = {}
            for align in ("every", "commit"):
                per = [r[m][align] for r in rs]
                cell[align] = {k: per[0][k] for k in ("words_committed", "stream_updates_aligned",
                                                      "stream_updates_without_alignment", "events_digest")}
                for k in ("median_step_cpu_ms", "median_step_host_ms"):
                    vals = [p[k] for p in per]
                    cell[align][k] = round(statistics.median(vals), 3)
                    cell[align][k + "_per_round"] = vals
                cell[align]["same_events_every_round"] = len({p["events_digest"] for p in per}) == 1
            res[label][mask] = cell
    for label, rs in runs.items():  # WhisperRunner._set_inputs at the start of the pass (host, GPU idle)
        res[label]["set_inputs_us"] = {k: round(statistics.median(r[2][k]["median_us"] for r in rs), 1)
                                       for k in ("with_drafts_and_frames", "without_drafts")}
        res[label]["set_inputs_us"]["table_digest"] = rs[0][2]["table_digest"]
    res["identical_set_inputs_table"] = len({res[label]["set_inputs_us"]["table_digest"] for label in runs}) == 1
    res["identical_events"] = all(res["before"][m][a]["events_digest"] == res["after"][m][a]["events_digest"]
                                  for m in ("all_voiced", "speech_mask") for a in ("every", "commit"))
    return res


def bench_medfilt(device: str = "cpu", iters: int = 10) -> dict[str, Any]:
    """The alignment matrix's 7-tap median filter at 16 streams × 6 heads × 33 rows × 500 frames:
    `unfold().median()` (before) vs the compare-exchange network `median7` (after); identical output."""
    from tristream.speech.timing import median7

    x = torch.randn(96, 33, 506, device=device)
    t = 500

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    def run(fn: Callable[[], torch.Tensor]) -> float:
        for _ in range(2):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return round((time.perf_counter() - t0) / iters * 1e3, 3)

    before = lambda: x.unfold(-1, 7, 1).median(dim=-1).values  # noqa: E731
    after = lambda: median7([x[..., i : i + t] for i in range(7)])  # noqa: E731
    return {"device": device, "shape": [96, 33, 500], "identical": bool(torch.equal(before(), after())),
            "unfold_median_ms": run(before), "median7_network_ms": run(after)}
