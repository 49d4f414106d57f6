"""GPU: every (batch, audio) bucket's graphed pass equals the eager pass on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tristream.speech.config import WhisperTokens
from tristream.speech.runner import WhisperRunner

TOKENS = WhisperTokens.for_vocab(51865)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_graph_replay_equals_eager_for_every_bucket(dtype: torch.dtype, make_whisper) -> None:  # type: ignore[no-untyped-def]
    model = make_whisper().to("cuda", dtype)
    kw = dict(batch_buckets=(1, 2, 4), audio_buckets_s=(2.0, 5.0), max_new_tokens=12, chunk=4, early_stop=False,
              max_draft=8)
    graphed = WhisperRunner(model, TOKENS, use_graphs=True, **kw)  # type: ignore[arg-type]
    eager = WhisperRunner(model, TOKENS, use_graphs=False, **kw)  # type: ignore[arg-type]
    graphed.capture()
    assert graphed.stats.captured == 3 * 2 * (3 + 3)  # encode, prefill, steps 4/2/1, align per bucket
    rng = np.random.default_rng(0)
    for ab in (2.0, 5.0):
        for bb in (1, 2, 4):
            audio = [(0.1 * rng.standard_normal(int(ab * 16000) - 800 * i)).astype(np.float32) for i in range(bb)]
            g, e = graphed.run(audio), eager.run(audio)
            assert (g.batch_bucket, g.audio_bucket_s) == (bb, ab)
            np.testing.assert_array_equal(g.tokens, e.tokens)
            np.testing.assert_array_equal(g.frames, e.frames)
            drafts = [row[:8].tolist() for row in e.tokens]
            drafts[0][3] = (drafts[0][3] + 1) % 50000
            gd, ed = graphed.run(audio, drafts), eager.run(audio, drafts)
            np.testing.assert_array_equal(gd.tokens, ed.tokens)
            np.testing.assert_array_equal(gd.accepted, ed.accepted)
            np.testing.assert_array_equal(gd.frames, ed.frames)
            assert gd.accepted[0] <= 3 and gd.steps <= g.steps


@pytest.mark.gpu
def test_device_audio_store_pass_equals_host_pass(make_whisper) -> None:  # type: ignore[no-untyped-def]
    from tristream.speech.audio_store import AudioStore

    model = make_whisper().to("cuda", torch.float16)
    r = WhisperRunner(model, TOKENS, batch_buckets=(1, 4), audio_buckets_s=(2.0,), max_new_tokens=8, chunk=4,
                      early_stop=False)
    store = AudioStore(4, 32000, "cuda")
    rng = np.random.default_rng(1)
    audio = [(0.1 * rng.standard_normal(12000 + 3000 * i)).astype(np.float32) for i in range(3)]
    slots = [store.acquire() for _ in audio]
    for s, a in zip(slots, audio, strict=True):
        for k in range(0, a.size, 2560):  # pinned async uploads, chunk by chunk
            store.append(s, a[k : k + 2560])
    a_res, b_res = r.run_store(store, slots), r.run(audio)
    np.testing.assert_array_equal(a_res.tokens, b_res.tokens)
    np.testing.assert_array_equal(a_res.frames, b_res.frames)


@pytest.mark.gpu
@pytest.mark.parametrize("align", ["every", "commit"])
def test_graphed_streaming_with_drafts_equals_eager(make_whisper, align: str) -> None:  # type: ignore[no-untyped-def]
    """Many streams, 0.32 s updates, drafts and DTW word times (every update, or only committing
    updates through `align_rows` on smaller graphed buckets): graphed and eager give the same words."""
    from tristream.speech.streaming import StreamingWhisper

    model = make_whisper().to("cuda", torch.float32)
    kw = dict(batch_buckets=(1, 4), audio_buckets_s=(2.0, 4.0), max_new_tokens=10, chunk=2, early_stop=False,
              max_draft=9)
    rng = np.random.default_rng(2)
    audio = [(0.1 * rng.standard_normal(48000)).astype(np.float32) for _ in range(3)]
    out = []
    for graphs in (True, False):
        asr = StreamingWhisper(WhisperRunner(model, TOKENS, use_graphs=graphs, **kw),  # type: ignore[arg-type]
                               lambda t: f" w{t % 7}", min_update_s=0.32, trim_after_s=3.0, keep_s=1.0, align=align)
        for i in range(3):
            asr.open(f"s{i}", 0)
        words = []
        for k in range(0, 48000, 5120):
            for i, a in enumerate(audio):
                asr.push(f"s{i}", a[k : k + 5120])
            words += [(e.stream_id, w) for e in asr.step() for w in e.committed + e.partial]
        out.append((words, asr.runner.stats.draft_accepted))
        if graphs:
            assert asr.runner.stats.eager_passes == 0 and asr.runner.stats.captured > 0
    assert out[0] == out[1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_graphs_with_step_kernels_equal_torch_ops(dtype: torch.dtype, make_whisper) -> None:  # type: ignore[no-untyped-def]
    """Graphed passes with the decoder step kernels (speech/kernels.py, the CUDA default) against
    graphed passes with the torch ops, every bucket, with and without drafts.

    fp32: the same tokens, accepted drafts and step counts; fp16: the same in at least 90% of the
    rows. The fused layer norm may round its fp16 output differently from torch's (one fp16
    rounding), and the random test model's logits have near-ties (top-2 gaps of 0.035 measured on
    the H200, about ten fp16 roundings of a logit): the H200 run flipped one row of 84, from its
    first token on. Word-time frames of rows with equal tokens: 98% equal, and in fp32 within one
    frame of each other (a near-tie in the alignment matrix moves a frame by one). In fp16 a moved
    frame can move far: the random model's alignment matrix is flat, and the H200 run had one DTW
    path 13 frames apart (5 s, 16 streams) with every token equal. A broken kernel (a wrong row,
    position or cache slot) changes nearly every row.

    Both runners keep the cuDNN convolution front (`gemm_front = False`): the GEMM front changes the
    encoder's GELU (tanh form) and so every cross-attention input, which moves near-tie DTW frames of
    this flat random model (the H200 run at 11e7184: 97.2% equal frames with it). It has its own test,
    `test_gemm_front_matches_cudnn_front`."""
    from tristream.speech import kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    model = make_whisper().to("cuda", dtype)
    model.gemm_front = False
    kw = dict(batch_buckets=(1, 4, 16), audio_buckets_s=(2.0, 5.0), max_new_tokens=12, chunk=4, early_stop=False,
              max_draft=8)
    fused = WhisperRunner(model, TOKENS, use_graphs=True, **kw)  # type: ignore[arg-type]
    plain = WhisperRunner(model, TOKENS, use_graphs=True, fused_kernels=False, **kw)  # type: ignore[arg-type]
    assert fused.fused_kernels and not plain.fused_kernels
    rng = np.random.default_rng(3)
    same_frames, total, same_rows, rows = 0, 0, 0, 0
    for ab in (2.0, 5.0):
        for bb in (1, 4, 16):
            audio = [(0.1 * rng.standard_normal(int(ab * 16000) - 500 * i)).astype(np.float32) for i in range(bb)]
            a, b = fused.run(audio), plain.run(audio)
            drafts = [row[:8].tolist() for row in b.tokens]
            drafts[0][3] = (drafts[0][3] + 1) % 50000
            dfr = [row[:9].tolist() for row in b.frames]
            ad, bd = fused.run(audio, drafts, dfr), plain.run(audio, drafts, dfr)
            for x, y in ((a, b), (ad, bd)):
                same = (x.tokens == y.tokens).all(1)
                if dtype == torch.float32:
                    np.testing.assert_array_equal(x.tokens, y.tokens)
                    assert x.steps == y.steps
                where = f"{dtype} {ab}s {bb} streams, drafts {x is ad}"
                np.testing.assert_array_equal(x.accepted[same], y.accepted[same], err_msg=where)
                same_rows += int(same.sum())
                rows += len(same)
                fx, fy = x.frames[same], y.frames[same]
                if dtype == torch.float32:
                    assert fx.size == 0 or np.abs(fx - fy).max() <= 1, (where, fx, fy)
                same_frames += int((fx == fy).sum())
                total += fx.size
    assert same_rows >= 0.9 * rows, (same_rows, rows)
    assert same_frames >= 0.98 * total, (same_frames, total)
    assert fused.stats.eager_passes == 0 and plain.stats.eager_passes == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemm_front_matches_cudnn_front(dtype: torch.dtype, make_whisper) -> None:  # type: ignore[no-untyped-def]
    """The fused encoder's GEMM front (both convolutions as im2col GEMMs with GELU in the cuBLASLt
    epilogue, fc1's GELU there too, positions added in the first layer norm's kernel) against the
    cuDNN front with exact GELUs, on the same weights.

    Encoder output: the epilogue's GELU is the tanh form (3.6e-4 relative from erf on fc1's output,
    measured on the H200), so the bound is 4e-3 in fp16 and 3e-2 in bf16 (8 bits of mantissa); a wrong
    tap order, stride or position row lands far off (checked with a shifted position table). Graphed passes: the same tokens in at least 90% of the
    rows, every bucket. Word-time frames are not compared: the random model's flat alignment matrix
    moves near-tie frames (see the step-kernel test)."""
    from tristream.speech import kernels
    from tristream.speech.mel import LogMel

    if not kernels.available():
        pytest.skip("needs Triton")
    model = make_whisper().to("cuda", dtype)
    mel = LogMel(model.dims.n_mels).to("cuda")
    rng = np.random.default_rng(5)
    bound = 4e-3 if dtype == torch.float16 else 3e-2
    with torch.no_grad():
        for b, seconds in ((1, 2.0), (3, 4.0), (16, 5.0)):  # the test model's window is 5 s
            wave = torch.from_numpy((0.1 * rng.standard_normal((b, int(seconds * 16000)))).astype(np.float32))
            x = mel(wave.cuda()).to(dtype)
            model.gemm_front = True
            gemm = model.encode(x, fused=True).float()
            model.gemm_front = False
            ref = model.encode(x, fused=True).float()
            exact = model.encode(x, fused=False).float()
            for got in (gemm, ref):
                assert got.shape == exact.shape
            err = ((gemm - ref).norm() / ref.norm()).item()
            assert err < bound, (b, seconds, err)
            assert ((gemm - exact).norm() / exact.norm()).item() < bound
            # a position table shifted by one row lands 10x further off than the GEMM front does
            model.gemm_front = True
            pos = model.enc_pos.data.clone()
            model.enc_pos.data = torch.roll(pos, 1, 0)
            off = model.encode(x, fused=True).float()
            model.enc_pos.data = pos
            assert ((off - ref).norm() / ref.norm()).item() > 10 * err, err

    model.gemm_front = True
    kw = dict(batch_buckets=(1, 4, 16), audio_buckets_s=(2.0, 5.0), max_new_tokens=12, chunk=4, early_stop=False)
    gemm_runner = WhisperRunner(model, TOKENS, use_graphs=True, **kw)  # type: ignore[arg-type]
    gemm_runner.capture()
    model.gemm_front = False  # read at capture: each runner's graphs keep the front they were captured with
    cudnn_runner = WhisperRunner(model, TOKENS, use_graphs=True, **kw)  # type: ignore[arg-type]
    cudnn_runner.capture()
    same_rows = rows = 0
    for ab in (2.0, 5.0):
        for bb in (1, 4, 16):
            audio = [(0.1 * rng.standard_normal(int(ab * 16000) - 500 * i)).astype(np.float32) for i in range(bb)]
            ga, ca = gemm_runner.run(audio), cudnn_runner.run(audio)
            same_rows += int((ga.tokens == ca.tokens).all(1).sum())
            rows += bb
    assert same_rows >= 0.9 * rows, (same_rows, rows)
    assert gemm_runner.stats.eager_passes == 0 and cudnn_runner.stats.eager_passes == 0
