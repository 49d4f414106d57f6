"""End to end on CPU: spoken turns of 2–28 s streamed in real time through `tristream serve`.

Each client is a live microphone over WebSocket: pcm16 at 24 kHz in 20 ms appends at real
time, silence between turns until the answer is done. Turns come from `speech_turns` (piper at
two speeds, espeak-ng at 150 and 190 words per minute, 1–7 sentences). Per turn, on the
client's clock:

- from the server's ``input_audio_buffer.speech_stopped`` to the last
  ``conversation.item.input_audio_transcription.completed``, the first text delta and the
  first audio delta (the issue's definition of "end of speech"); the same from the last voiced
  chunk sent (what a user waits, VAD hangover included);
- the transcript's WER against the text read, and against whole-utterance Whisper base on the
  same clip (`WhisperASR.transcribe`, computed here in the bench process);
- transcription deltas that arrived before the end of the turn's audio, and answers that
  started before it (a turn cut in two).

Variants in the same run: ``whisper`` (streaming ASR with incremental prefill, the default)
and ``whisper-utterance`` (one decode per utterance at its end: the previous design, the peer).

    .venv/bin/python bench/e2e_cpu.py                       # both variants, 1 and 4 sessions
    .venv/bin/python bench/e2e_cpu.py --sessions 1 --asr whisper --per-count 1
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as serve_bench  # noqa: E402  (bench/serve.py: one way to start a server)
from _common import (  # noqa: E402
    RESULTS_DIR,
    busy_cores,
    cpu_info,
    host_speed,
    last_voiced_chunk,
    machine_info,
    note_turn_event,
    process_cpu_s,
    stop_process,
    turn_latencies_ms,
)
from speech_turns import Turn, make_turns, wer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = serve_bench.TOKEN
RATE = 24_000
STEP = RATE // 50  # 20 ms appends


def start_server(asr: str, n: int) -> tuple[subprocess.Popen[str], int]:
    """`tristream serve` (the assistant, this ASR) in its own process, once it listens."""
    return serve_bench.start_server(f"assistant:asr={asr}", n)


def _pcm16(pcm16k: np.ndarray) -> np.ndarray:
    from tristream.stages.base import resample

    x = resample(pcm16k, 16_000, RATE)
    return (np.clip(x, -1, 1) * 32767).astype(np.int16)


async def one_session(url: str, turns: list[Turn], gap_s: float, wait_s: float) -> list[dict[str, Any]]:
    """Speak `turns` one after the other as a live microphone; one record per turn."""
    from websockets.asyncio.client import connect

    records: list[dict[str, Any]] = []
    async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, compression=None,
                       max_size=None) as ws:
        json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "session.update", "session": {"input_audio_sample_rate": RATE}}))
        cur: dict[str, Any] = {}
        done = asyncio.Event()

        async def reader() -> None:
            async for raw in ws:
                if cur and note_turn_event(cur, json.loads(raw), time.perf_counter()):
                    done.set()

        rtask = asyncio.get_running_loop().create_task(reader())
        silence = np.zeros(STEP, np.int16)
        try:
            for turn in turns:
                pcm = _pcm16(turn.pcm)
                last_voiced = last_voiced_chunk(pcm, STEP)
                cur.clear()
                cur.update(deltas=0, deltas_before_end=0, transcripts=[], responses=0, early_responses=0, errors=[])
                done.clear()
                t0 = time.perf_counter()
                for i in range(0, pcm.size, STEP):
                    delay = t0 + i / RATE - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm[i:i + STEP].tobytes()).decode()}))
                    if i == last_voiced:
                        cur["eos"] = time.perf_counter() + STEP / RATE
                cur["audio_sent"] = time.perf_counter()
                t1 = time.perf_counter()
                k = 0
                while not done.is_set() and time.perf_counter() - t1 < wait_s:  # the microphone stays open
                    delay = t1 + k * STEP / RATE - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(silence.tobytes()).decode()}))
                    k += 1
                rec = _record(turn, cur)
                records.append(rec)
                await asyncio.sleep(gap_s)
        finally:
            rtask.cancel()
    return records


def _record(turn: Turn, cur: dict[str, Any]) -> dict[str, Any]:
    text = " ".join(cur["transcripts"])
    edits, words = wer(turn.text, text)
    return {"voice": turn.voice, "seconds": round(turn.seconds, 2), "words": words, "edits": edits,
            "transcript": text, **turn_latencies_ms(cur),
            "transcription_deltas": cur["deltas"], "deltas_before_end_of_audio": cur["deltas_before_end"],
            "responses": cur["responses"], "responses_started_before_end_of_audio": cur["early_responses"],
            "status": cur.get("status"), "server_latency_ms": cur.get("server_latency_ms"), "errors": cur["errors"]}


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 1) if xs else None


def summarise(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """P50/P99 of each latency, by turn-length bucket too, and the WER."""
    out: dict[str, Any] = {"turns": len(recs)}
    keys = ("stopped_to_transcript_ms", "stopped_to_first_text_ms", "stopped_to_first_audio_ms", "eos_to_first_audio_ms")
    for k in keys:
        xs = [r[k] for r in recs if r[k] is not None]
        out[k] = {"p50": _pct(xs, 50), "p99": _pct(xs, 99), "n": len(xs)}
    buckets: dict[str, Any] = {}
    for lo, hi in ((0, 5), (5, 12), (12, 20), (20, 60)):
        sel = [r for r in recs if lo <= r["seconds"] < hi]
        if sel:
            buckets[f"{lo}-{hi}s"] = {
                "turns": len(sel),
                **{k: _pct([r[k] for r in sel if r[k] is not None], 50) for k in keys[:3]}}
    out["p50_by_length"] = buckets
    out["wer"] = round(sum(r["edits"] for r in recs) / max(1, sum(r["words"] for r in recs)), 4)
    out["turns_with_partials_before_end"] = sum(1 for r in recs if r["deltas_before_end_of_audio"] > 0)
    out["turns_answered_before_end_of_audio"] = sum(1 for r in recs if r["responses_started_before_end_of_audio"] > 0)
    out["errors"] = sum(len(r["errors"]) for r in recs)
    return out


def _cpu_ticks() -> list[int]:
    """The machine's CPU time so far by kind (/proc/stat: user nice system idle iowait irq
    softirq steal); empty where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return []


def steal_share(a: list[int], b: list[int]) -> float | None:
    """Share of the machine's CPU time between two `_cpu_ticks` taken by the hypervisor (a VM's
    neighbours): a run with more steal is slower for reasons outside the code."""
    if len(a) < 8 or len(b) < 8:
        return None
    d = [y - x for x, y in zip(a, b, strict=True)]
    return round(d[7] / max(1, sum(d)), 4)


def server_counters(port: int) -> dict[str, float]:
    """The server's backend, stage and ASR counters from `/metrics` (name → value)."""
    import urllib.request

    out: dict[str, float] = {}
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        fam, rest = line.split("{", 1)
        labels, _, value = rest.rpartition("}")
        if fam in ("tristream_asr_counter", "tristream_backend_counter", "tristream_stage_counter") \
                or fam.startswith("tristream_transcription"):
            name = labels.split('"')[1] if '"' in labels else labels
            try:
                out[f"{fam}:{name}"] = float(value)
            except ValueError:
                continue
    return out


def run_variant(asr: str, n: int, turns: list[Turn], gap_s: float, wait_s: float,
                omp: str = "passive") -> dict[str, Any]:
    """One server (`asr`, OpenMP wait policy `omp`: the server's default is passive,
    `core/openmp.py`) and `n` clients speaking `turns` between them."""
    before = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = omp.upper()
    try:
        proc, port = start_server(asr, n)
    finally:
        if before is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        else:
            os.environ["OMP_WAIT_POLICY"] = before
    try:
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        per = [turns[i::n] for i in range(n)]
        cpu0, w0, t0 = process_cpu_s(proc.pid), time.perf_counter(), _cpu_ticks()

        async def everyone() -> list[list[dict[str, Any]]]:
            return await asyncio.gather(*(one_session(url, p, gap_s, wait_s) for p in per))

        recs = [r for rs in asyncio.run(everyone()) for r in rs]
        cpu1, w1, t1 = process_cpu_s(proc.pid), time.perf_counter(), _cpu_ticks()
        counters = server_counters(port)
    finally:
        stop_process(proc, 15)
    return {"asr": asr, "sessions": n, "omp_wait_policy": omp, "summary": summarise(recs), "server_cpu_s": round(cpu1 - cpu0, 1),
            "wall_s": round(w1 - w0, 1), "loadavg_1m": round(os.getloadavg()[0], 2),
            "steal_share": steal_share(t0, t1), "host_speed": host_speed(), "server_counters": counters, "turns": recs}


def whole_utterance_wer(turns: list[Turn]) -> float:
    """WER of whole-utterance Whisper base (one decode of each clip) over the same turns."""
    from tristream.stages.asr_whisper import WhisperASR

    asr = WhisperASR()
    e = w = 0
    for t in turns:
        de, dw = wer(t.text, asr.transcribe(t.pcm[-30 * 16_000:]))
        e, w = e + de, w + dw
    return round(e / max(1, w), 4)


BACKCHANNEL_TEXTS = ("Mhm.", "Yeah.", "Okay.", "Uh-huh.", "Right.", "I see.")
INTERRUPTIONS = ("Wait, stop, tell me about the weather instead.", "No, I asked about something else entirely.",
                 "Sorry, can you tell me what time it is in Tokyo?", "Hold on, I want to ask about trains.")
QUESTION = "Tell me a short story about a brave little mouse."


def _clip(tts: Any, text: str) -> np.ndarray:
    from tristream.stages.base import resample
    from tristream.stages.synth import energy_edges

    pcm = resample(tts.synthesize_exact(text) if hasattr(tts, "synthesize_exact") else tts.synthesize(text),
                   tts.sample_rate, 16_000)
    a, b = energy_edges(pcm, 16_000)
    return pcm[a:b].astype(np.float32)


async def overlap_run(models: Any, phone: Any, clip: np.ndarray | None, offset_s: float = 1.2) -> dict[str, Any]:
    """One spoken answer on a speakerphone, optionally with `clip` spoken over it `offset_s` after
    its first audio; what happened to the answer and how fast its audio stopped."""
    from speakerphone import clip_player, converse

    from tristream.pipeline.session import Session, SessionConfig

    s = Session(models, sink=phone, config=SessionConfig())
    s.start()
    s.ask(QUESTION, speak=True)

    def clip_start() -> int | None:
        rec = s.records[0] if s.records else None
        return None if rec is None or rec.first_audio_ns is None else rec.first_audio_ns + int(offset_s * 1e9)

    user = clip_player(clip, clip_start) if clip is not None else None
    end = {"t": None}

    def done() -> bool:
        rec = s.records[0] if s.records else None
        if rec is None or not rec.status:
            return False
        end["t"] = end["t"] or time.monotonic_ns()
        return time.monotonic_ns() - end["t"] > 5e8

    await converse(s, phone, 40.0, user, done)
    rec = s.records[0]
    start = clip_start()
    paused = s.playout.paused_at_ns
    after_pause = sum(1 for w in phone.writes if paused is not None and w > paused and
                      (not s.barge_ins or w < s.barge_ins[0]["at_ns"]))
    out = {"status": rec.status, "overlaps": dict(s.overlaps), "barge_ins": len(s.barge_ins),
           "echo": s.stats()["echo"],
           "speech_to_pause_ms": round((paused - start) / 1e6, 1) if paused and start and paused > start else None,
           "chunks_written_while_paused": after_pause}
    await s.close()
    return out


def overlap_section(seed: int = 0) -> dict[str, Any]:
    """False interruptions by echo and by backchannels, and how fast real interruptions stop the answer."""
    from speakerphone import Speakerphone

    from tristream.pipeline.models import load_models
    from tristream.stages.tts import PiperTTS

    models = load_models(asr="whisper", vision=False)
    voice = PiperTTS(deterministic=True)
    rooms = [(g, d, rt) for g in (-6.0, -12.0, -20.0) for d in (20.0, 80.0, 150.0) for rt in (0.2, 0.5)]
    runs: dict[str, list[dict[str, Any]]] = {"echo": [], "backchannel": [], "interruption": []}

    async def all_runs() -> None:
        for i, (g, d, rt) in enumerate(rooms):
            r = await overlap_run(models, Speakerphone(g, d, rt, seed=seed + i), None)
            runs["echo"].append({"gain_db": g, "delay_ms": d, "rt60_s": rt, **r})
            print("echo", g, d, rt, r["status"], r["overlaps"], flush=True)
        for i, text in enumerate(BACKCHANNEL_TEXTS * 2):
            g, d, rt = rooms[(3 * i) % len(rooms)]
            r = await overlap_run(models, Speakerphone(g, d, rt, seed=100 + i), _clip(voice, text))
            runs["backchannel"].append({"text": text, "gain_db": g, "delay_ms": d, **r})
            print("backchannel", text, r["status"], r["overlaps"], flush=True)
        for i, text in enumerate(INTERRUPTIONS * 2):
            g, d, rt = rooms[(5 * i) % len(rooms)]
            r = await overlap_run(models, Speakerphone(g, d, rt, seed=200 + i), _clip(voice, text))
            runs["interruption"].append({"text": text, "gain_db": g, "delay_ms": d, **r})
            print("interruption", text, r["status"], r["speech_to_pause_ms"], r["chunks_written_while_paused"], flush=True)

    asyncio.run(all_runs())
    echo_false = sum(1 for r in runs["echo"] if r["status"] != "completed")
    bc_false = sum(1 for r in runs["backchannel"] if r["status"] != "completed")
    stopped = [r for r in runs["interruption"] if r["status"] == "cancelled"]
    lat = [r["speech_to_pause_ms"] for r in stopped if r["speech_to_pause_ms"] is not None]
    return {"answers_with_echo": len(runs["echo"]),
            "false_interruptions_by_echo_per_100": round(100 * echo_false / len(runs["echo"]), 1),
            "answers_with_backchannel": len(runs["backchannel"]),
            "false_interruptions_by_backchannel_per_100": round(100 * bc_false / len(runs["backchannel"]), 1),
            "interruptions": len(runs["interruption"]), "interruptions_that_stopped_the_answer": len(stopped),
            "speech_onset_to_audio_paused_ms": {"p50": _pct(lat, 50), "max": _pct(lat, 100)},
            "chunks_written_after_pause_max": max((r["chunks_written_while_paused"] for r in stopped), default=None),
            "runs": runs}


def turn_section(hold_ms: float = 700.0, pauses_ms: tuple[float, ...] = (350.0, 500.0, 800.0)) -> dict[str, Any]:
    """Smart Turn on a labelled set: finished sentences, and the same sentences cut at a word
    boundary in their middle (a pause inside the sentence), from four voices.

    For each clip the model sees the speech so far plus 200 ms of silence (what it has at the
    end of a VAD segment). False cut-offs: cut sentences judged finished; late ends: finished
    sentences judged unfinished (each waits `hold_ms` more). The silence rule's figures for the
    same pauses: a pause of P ms inside a sentence cuts the turn whenever P ≥ the hangover.
    """
    from speech_turns import SENTENCES, _speak, _voices

    from tristream.pipeline.turns import DEFAULT_HANGOVER_MS
    from tristream.stages.asr_whisper import WhisperASR
    from tristream.stages.turn_model import SmartTurn

    asr, model = WhisperASR(), SmartTurn()
    tail = np.zeros(int(0.2 * 16_000), np.float32)
    done_p: list[float] = []
    cut_p: list[float] = []
    call_ms: list[float] = []
    examples: list[dict[str, Any]] = []
    for name, tts in _voices():
        for text in SENTENCES:
            pcm = _speak(tts, text, 0.0)
            enc, frames = asr.encode(pcm)
            toks = asr.generate(enc, [], [], max_new=96)
            words = asr.split_words(toks)
            times = asr.word_times(enc, toks, frames)
            t0 = time.perf_counter()
            p_done = model.probability(np.concatenate([pcm, tail]))
            call_ms.append((time.perf_counter() - t0) * 1000)
            done_p.append(p_done)
            if len(times) >= 6:  # cut after a word in the middle (not after punctuation)
                k = len(times) // 2
                while k > 1 and not words[k - 1][0].strip().isalpha():
                    k -= 1
                end = int(times[k - 1][1] * 16_000)
                p_cut = model.probability(np.concatenate([pcm[:end], tail]))
                cut_p.append(p_cut)
                examples.append({"voice": name, "cut_after": "".join(w for w, _ in words[:k]).strip(),
                                 "p_cut": round(p_cut, 3), "p_done": round(p_done, 3)})
    false_cut = sum(p >= 0.5 for p in cut_p)
    late = sum(p < 0.5 for p in done_p)
    silence = {f"pause_{int(p)}ms": {"hangover_300ms_cuts_turn": p >= DEFAULT_HANGOVER_MS} for p in pauses_ms}
    return {"finished": len(done_p), "cut_mid_sentence": len(cut_p),
            "smart_turn_false_cutoffs": false_cut, "smart_turn_false_cutoff_rate": round(false_cut / max(1, len(cut_p)), 3),
            "smart_turn_late_ends": late, "smart_turn_late_end_rate": round(late / max(1, len(done_p)), 3),
            "added_latency_mean_ms": round(hold_ms * late / max(1, len(done_p)), 1),
            "model_call_ms": {"p50": _pct(call_ms, 50), "p99": _pct(call_ms, 99)},
            "silence_rule": {"hangover_ms": DEFAULT_HANGOVER_MS, "cuts_every_pause_longer_than_it": True, **silence},
            "hold_ms": hold_ms, "examples": examples}


def _decode_probe() -> None:
    """In a fresh process (the policy is read when torch loads): ms and CPU ms per token of a
    greedy 64-token answer of the embedded LLM, median of 3, printed as JSON."""
    from tristream.engine.cli_support import load_engine
    from tristream.engine.sequence import SamplingParams

    eng = load_engine(None, "cpu", "auto")
    chat = [{"role": "user", "content": "Tell me a long story about a brave little mouse and a cat."}]

    def answer() -> tuple[float, float]:
        sid = eng.add_request(chat=chat, params=SamplingParams(max_tokens=64, temperature=0.0))
        n, t_first, c_first = 0, 0.0, 0.0
        while eng.has_work():
            for o in eng.step():
                if o.seq_id == sid:
                    n += 1
                    if n == 1:
                        t_first, c_first = time.perf_counter(), time.process_time()
        return ((time.perf_counter() - t_first) * 1e3 / max(1, n - 1),
                (time.process_time() - c_first) * 1e3 / max(1, n - 1))

    answer()
    runs = sorted(answer() for _ in range(3))
    print(json.dumps({"ms_per_token": round(runs[1][0], 2), "cpu_ms_per_token": round(runs[1][1], 2)}))


OMP_VARIANTS: dict[str, dict[str, str]] = {
    "default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin_30000": {"GOMP_SPINCOUNT": "30000"}, "spin_3000": {"GOMP_SPINCOUNT": "3000"}}
"""libgomp settings of the decode probe: its default (spin 300,000 rounds before sleeping),
passive (sleep at once) and shorter spins."""


def omp_section(busy_counts: tuple[int, ...] = (0, 1, 2)) -> dict[str, Any]:
    """The embedded LLM's decode (2 OpenMP threads) at each of `OMP_VARIANTS`, alone and beside
    1 or 2 busy cores (processes that spin: what Whisper, piper or another program is to the LLM),
    each in a fresh process (libgomp reads its settings when it loads)."""
    out: dict[str, Any] = {}
    for busy in busy_counts:
        with busy_cores(busy):
            for name, extra in OMP_VARIANTS.items():
                env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
                env.update(extra)
                res = subprocess.run([sys.executable, __file__, "--decode-probe"], env=env, capture_output=True,
                                     text=True, check=True, timeout=600)
                key = f"{name}_beside_{busy}_busy" if busy else f"{name}_alone"
                out[key] = json.loads(res.stdout.strip().splitlines()[-1])
                print("omp", key, out[key], flush=True)
    return out


def main() -> None:
    if "--decode-probe" in sys.argv:
        _decode_probe()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--asr", nargs="+", default=["whisper", "whisper-utterance"])
    ap.add_argument("--per-count", type=int, default=1, help="texts per sentence count (each read by 4 voices)")
    ap.add_argument("--gap-s", type=float, default=1.0)
    ap.add_argument("--wait-s", type=float, default=20.0)
    ap.add_argument("--limit", type=int, default=0, help="only the first N turns (a smoke run)")
    ap.add_argument("--out", default="e2e_cpu")
    ap.add_argument("--section", nargs="+", default=["e2e", "overlap"], choices=["e2e", "overlap", "turn", "omp"])
    ap.add_argument("--omp", nargs="+", default=["passive"], choices=["passive", "active"],
                    help="OpenMP wait policies of the server: the first for every run, the others for the streaming variant at the most sessions")
    args = ap.parse_args()
    path = RESULTS_DIR / f"{args.out}.json"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.is_file() else {}
    meta = {**machine_info(("ctranslate2", "faster_whisper")), "cpu": cpu_info()}
    if "overlap" in args.section:
        old["overlap"] = {"meta": meta, "results": overlap_section()}
        path.write_text(json.dumps(old, indent=1) + "\n")
        print({k: v for k, v in old["overlap"]["results"].items() if k != "runs"}, flush=True)
    if "turn" in args.section:
        old["turn_model"] = {"meta": meta, "results": turn_section()}
        path.write_text(json.dumps(old, indent=1) + "\n")
        print({k: v for k, v in old["turn_model"]["results"].items() if k != "examples"}, flush=True)
    if "omp" in args.section:
        old["omp"] = {"meta": {**meta, "load_avg_1m": os.getloadavg()[0]}, "results": omp_section()}
        path.write_text(json.dumps(old, indent=1) + "\n")
    if "e2e" not in args.section:
        return
    turns = make_turns(per_count=args.per_count)
    if args.limit:
        turns = turns[::max(1, len(turns) // args.limit)][:args.limit]
    print(f"{len(turns)} turns, {min(t.seconds for t in turns):.1f}-{max(t.seconds for t in turns):.1f} s", flush=True)
    results: dict[str, Any] = {"turn_seconds": sorted(round(t.seconds, 1) for t in turns),
                               "whole_utterance_wer": whole_utterance_wer(turns), "runs": []}
    for asr in args.asr:
        for n in args.sessions:
            if asr != "whisper" and n > 1 and 1 in args.sessions:
                continue  # the peer at one session is enough for the comparison
            # the other policies: the streaming variant at the most sessions (where cores are shared most)
            for omp in args.omp if asr == "whisper" and n == max(args.sessions) else args.omp[:1]:
                r = run_variant(asr, n, turns, args.gap_s, args.wait_s, omp)
                results["runs"].append(r)
                s = r["summary"]
                print(f"{asr:18s} n={n} omp={omp}: transcript P50 {s['stopped_to_transcript_ms']['p50']} ms, first audio "
                      f"P50 {s['stopped_to_first_audio_ms']['p50']} / P99 {s['stopped_to_first_audio_ms']['p99']} ms, "
                      f"WER {s['wer']:.3f}, steal {r['steal_share']}, by length {s['p50_by_length']}", flush=True)
    results["wer_ratio_stream_vs_whole"] = next(
        (round(r["summary"]["wer"] / max(results["whole_utterance_wer"], 1e-9), 3)
         for r in results["runs"] if r["asr"] == "whisper" and r["sessions"] == 1 and r["omp_wait_policy"] == args.omp[0]),
        None)
    old["e2e"] = {"meta": meta, "results": results}
    path.write_text(json.dumps(old, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
