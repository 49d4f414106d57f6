"""Pipeline benchmark: framework overhead vs Pipecat, VAD hangover vs false turn splits, demo latency.

1. Overhead: 5 pass-through stages, one 20 ms audio packet pushed at a time, head→tail
   latency (P50/P99 µs) and pipelined throughput (packets/s); the same for Pipecat 1.14's
   `Pipeline` of 5 pass-through `FrameProcessor`s (`PipelineWorker`, default settings and
   lean: RTVI and turn tracking off), in the same run, alternating rounds. Pipecat lives in
   a separate venv (it pulls numba and downgrades protobuf): its half runs in that
   interpreter through a subprocess when `pipecat` is not importable here.
2. Hangover: silero VAD over synthetic speech (sentences with commas and pauses) with
   each candidate `min_silence_ms`; a segment split inside one sentence is a false end of turn.
3. Demo (`--demo`): the bundled conversation through the real pipeline in real time on
   this machine; per-turn end of speech → ASR final / first token / first audio.

    .venv/bin/python bench/pipeline.py [--n 10000] [--rounds 3] [--demo] [--demo-only] [--pipecat-python PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import write_results  # noqa: E402

PIPECAT_SCRIPT = r'''
import asyncio, json, sys, time
from loguru import logger
logger.remove()
from pipecat.frames.frames import Frame, OutputAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner
import importlib.metadata as md

N, STAGES, LEAN = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "lean"

class Pass(FrameProcessor):
    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)

class Tail(FrameProcessor):
    def __init__(self):
        super().__init__()
        self.event = asyncio.Event()
        self.seen = 0
    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, OutputAudioRawFrame):
            self.seen += 1
            self.event.set()
        await self.push_frame(frame, direction)

async def main():
    tail = Tail()
    pipe = Pipeline([*[Pass() for _ in range(STAGES)], tail])
    kw = dict(idle_timeout_secs=None, check_dangling_tasks=False)
    if LEAN:
        kw.update(enable_rtvi=False, enable_turn_tracking=False)
    worker = PipelineWorker(pipe, **kw)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())
    await asyncio.sleep(0.5)
    pcm = b"\x00\x00" * 320
    lat = []
    for i in range(N + 200):
        f = OutputAudioRawFrame(audio=pcm, sample_rate=16000, num_channels=1)
        tail.event.clear()
        t0 = time.perf_counter_ns()
        await worker.queue_frame(f)
        await tail.event.wait()
        if i >= 200:
            lat.append(time.perf_counter_ns() - t0)
    start = tail.seen
    t0 = time.perf_counter()
    for i in range(N):
        await worker.queue_frame(OutputAudioRawFrame(audio=pcm, sample_rate=16000, num_channels=1))
    while tail.seen < start + N:
        tail.event.clear()
        await tail.event.wait()
    thr = N / (time.perf_counter() - t0)
    await worker.cancel()
    try:
        await asyncio.wait_for(run, 5)
    except Exception:
        pass
    print("RESULT " + json.dumps({"lat_ns": lat, "packets_per_s": thr,
                                  "version": md.version("pipecat-ai"), "python": sys.version.split()[0]}))

asyncio.run(main())
'''


def _pct(xs: list[int], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q / 100))] / 1e3


def ours(n: int, stages: int) -> dict[str, Any]:
    """Our runtime: head→tail latency per packet (one in flight) and pipelined throughput."""
    import numpy as np

    from tristream.core.packets import AudioChunk
    from tristream.pipeline.pipeline import Pipeline
    from tristream.pipeline.stage import Stage

    async def main() -> dict[str, Any]:
        p = Pipeline([Stage(f"pass{i}") for i in range(stages)])
        p.start()
        pcm = np.zeros(320, dtype=np.int16)
        lat: list[int] = []
        perf = time.perf_counter_ns
        for i in range(n + 200):
            pkt = AudioChunk(session_id="b", source_id="mic", ts=i * 320, unit="samples@16000",
                             arrival_ns=i, pcm=pcm, sample_rate=16000)
            t0 = perf()
            await p.push(pkt)
            await p.get()
            if i >= 200:
                lat.append(perf() - t0)

        async def reader() -> None:
            for _ in range(n):
                await p.get()

        r = asyncio.ensure_future(reader())
        t0 = time.perf_counter()
        for i in range(n):
            await p.push(AudioChunk(session_id="b", source_id="mic", ts=i * 320, unit="samples@16000",
                                    arrival_ns=i, pcm=pcm, sample_rate=16000))
        await r
        thr = n / (time.perf_counter() - t0)
        await p.stop()
        return {"lat_ns": lat, "packets_per_s": thr}

    return asyncio.run(main())


def pipecat(n: int, stages: int, lean: bool, python: str | None) -> dict[str, Any]:
    """Pipecat's half, here if importable, else in `python` (a separate venv)."""
    try:
        import pipecat as _pc  # noqa: F401

        exe, how = sys.executable, "same interpreter"
    except ImportError:
        exe = python or "/work/bench-venv-pipecat/bin/python"
        how = f"subprocess: {exe}"
        if not Path(exe).exists():
            raise SystemExit(f"pipecat is not importable and {exe} does not exist: "
                             "python3 -m venv /work/bench-venv-pipecat && "
                             "/work/bench-venv-pipecat/bin/pip install pipecat-ai==1.14.0") from None
    out = subprocess.run([exe, "-c", PIPECAT_SCRIPT, str(n), str(stages), "lean" if lean else "default"],
                         capture_output=True, text=True, timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"pipecat run failed:\n{out.stderr[-2000:]}")
    res = json.loads(line[7:])
    res["how"] = how
    return res


def summarize(lats: list[int], thr: list[float]) -> dict[str, float]:
    """P50/P99 µs over every measured packet, median throughput over rounds."""
    return {"p50_us": round(_pct(lats, 50), 2), "p99_us": round(_pct(lats, 99), 2),
            "mean_us": round(statistics.fmean(lats) / 1e3, 2), "packets": len(lats),
            "packets_per_s": round(statistics.median(thr), 0)}


def bench_overhead(n: int, rounds: int, stages: int, python: str | None) -> dict[str, Any]:
    acc: dict[str, tuple[list[int], list[float]]] = {k: ([], []) for k in ("ours", "pipecat_default", "pipecat_lean")}
    meta: dict[str, Any] = {}
    for r in range(rounds):
        for key in acc:
            if key == "ours":
                res = ours(n, stages)
            else:
                res = pipecat(n, stages, key == "pipecat_lean", python)
                meta = {"pipecat_version": res["version"], "pipecat_python": res["python"], "how": res["how"]}
            acc[key][0].extend(res["lat_ns"])
            acc[key][1].append(res["packets_per_s"])
            print(f"  round {r + 1}/{rounds} {key:16s} p50 {_pct(res['lat_ns'], 50):8.1f} µs", flush=True)
    out = {k: summarize(*v) for k, v in acc.items()}
    out["ratio_p50_pipecat_default_over_ours"] = round(out["pipecat_default"]["p50_us"] / out["ours"]["p50_us"], 2)
    out["ratio_p50_pipecat_lean_over_ours"] = round(out["pipecat_lean"]["p50_us"] / out["ours"]["p50_us"], 2)
    out["stages"] = stages
    out["packets_per_round"] = n
    out["rounds"] = rounds
    out["pipecat"] = meta
    return out


def bench_hangover(candidates: tuple[float, ...] = (150, 200, 250, 300, 350, 400, 500),
                   repeats: int = 3) -> dict[str, Any]:
    """False splits (one sentence cut into several VAD segments) per hangover on synthetic speech.

    Piper synthesis is not deterministic (noise), so the sentences are synthesised `repeats`
    times; a split inside a sentence would end the user's turn too early.
    """
    from tristream.pipeline.demo import DEMO_QUESTIONS
    from tristream.stages.synth import SENTENCES, make_track
    from tristream.stages.tts import default_tts
    from tristream.stages.vad import SileroVAD, VADOptions

    tts = default_tts()
    texts = tuple(SENTENCES) + DEMO_QUESTIONS + (
        "Well, I think that, if it rains tomorrow, we should stay home and, maybe, watch a film.",
        "First the eggs, then the flour, then the milk, and finally, a pinch of salt.",
    )
    tracks = [make_track(tts.synthesize, tts.sample_rate, texts, gaps_s=(1.2, 1.5, 1.3), seed=k)
              for k in range(repeats)]
    vad = SileroVAD()
    res: dict[str, Any] = {"sentences": len(texts) * repeats, "tts": getattr(tts, "name", type(tts).__name__),
                           "audio_s": round(sum(t.duration_s for t in tracks), 1), "texts": list(texts)}
    rows = []
    for h in candidates:
        split_sentences: list[str] = []
        n_seg = 0
        for track in tracks:
            st = vad.stream("h", VADOptions(min_silence_ms=h))
            ends: list[int] = []
            for i in range(0, track.pcm.shape[0], 320):
                st.push(track.pcm[i:i + 320], i * 62_500)
                ends += [e.sample_index for e in st.poll() if e.kind == "end"]
            st.flush()
            ends += [e.sample_index for e in st.poll() if e.kind == "end"]
            n_seg += len(ends)
            split_sentences += [s.text for s in track.segments if any(s.start < e < s.end - 1600 for e in ends)]
        rows.append({"hangover_ms": h, "segments": n_seg, "sentences_split": len(split_sentences),
                     "split": sorted(set(split_sentences))})
        print(f"  hangover {h:5.0f} ms: {n_seg} segments for {res['sentences']} sentences, "
              f"{len(split_sentences)} sentences cut (false end of turn)", flush=True)
    res["rows"] = rows
    return res


def bench_demo(runs: int, tts: str = "piper") -> dict[str, Any]:
    """The bundled demo in real time; latencies from end of speech (ms)."""
    from tristream.pipeline.demo import run_demo

    turns = []
    for _ in range(runs):
        r = run_demo(realtime=True, out_wav=None, quiet=True, tts=tts)
        for i, rec in enumerate(r.records):
            true_end = r.clip_end_ns[i] if i < len(r.clip_end_ns) else None
            turns.append({"user": rec.user_text, "answer": rec.answer, "scene": rec.scene, **rec.latency_ms(),
                          "first_piece": rec.first_piece, "first_piece_synth_ms": round(rec.first_piece_s * 1e3, 1),
                          "vad_edge_minus_true_end": None if true_end is None
                          else round((rec.speech_end_ns - true_end) / 1e6, 1),
                          "first_audio_from_true_end": None if true_end is None or rec.first_audio_ns is None
                          else round((rec.first_audio_ns - true_end) / 1e6, 1)})
    def p50(k: str) -> float | None:
        xs = [t[k] for t in turns if t[k] is not None]
        return round(statistics.median(xs), 1) if xs else None
    return {"runs": runs, "tts": tts, "turns": turns, "p50_ms": {k: p50(k) for k in ("asr_final", "llm_start", "first_token", "first_audio",
                                                      "first_audio_from_true_end", "vad_edge_minus_true_end")},
            "load_avg_1m": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stages", type=int, default=5)
    ap.add_argument("--demo", action="store_true", help="also run the demo in real time (needs the models)")
    ap.add_argument("--demo-runs", type=int, default=2)
    ap.add_argument("--demo-tts", default="piper,espeak", help="TTS engines to run the demo with")
    ap.add_argument("--no-hangover", action="store_true")
    ap.add_argument("--pipecat-python", default=None)
    ap.add_argument("--demo-only", action="store_true",
                    help="run only the demo part and keep the other parts of the existing JSON")
    args = ap.parse_args()
    results: dict[str, Any] = {"load_avg_1m_start": os.getloadavg()[0]}
    if args.demo_only:
        old = Path(ROOT / "bench" / "results" / "pipeline.json")
        if old.is_file():
            results = {**json.loads(old.read_text())["results"], **results}
        args.demo, args.no_hangover = True, True
    else:
        print(f"overhead: {args.stages} pass-through stages, {args.n} packets x {args.rounds} rounds")
        results["overhead"] = ov = bench_overhead(args.n, args.rounds, args.stages, args.pipecat_python)
        print(f"{'':18s}{'P50 µs':>10s}{'P99 µs':>10s}{'packets/s':>12s}")
        for k in ("ours", "pipecat_default", "pipecat_lean"):
            print(f"{k:18s}{ov[k]['p50_us']:10.1f}{ov[k]['p99_us']:10.1f}{ov[k]['packets_per_s']:12.0f}")
        print(f"Pipecat / ours at P50: default {ov['ratio_p50_pipecat_default_over_ours']}x, "
              f"lean {ov['ratio_p50_pipecat_lean_over_ours']}x")
    if not args.no_hangover:
        print("hangover vs false end-of-turn (silero VAD, synthetic speech):")
        results["hangover"] = bench_hangover()
    if args.demo:
        for tts, key in (("piper", "demo"), ("espeak", "demo_espeak")):
            if tts in args.demo_tts.split(","):
                print(f"demo in real time, {tts} TTS:")
                results[key] = d = bench_demo(args.demo_runs, tts)
                print(f"demo P50 from end of speech (ms), {tts}: {d['p50_ms']}")
    results["load_avg_1m_end"] = os.getloadavg()[0]
    path = write_results("pipeline", results, extra_modules=("onnxruntime", "faster_whisper", "httpx"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
