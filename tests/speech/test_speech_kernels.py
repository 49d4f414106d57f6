"""Decoder-step Triton kernels (speech/kernels.py) against their torch twins: fused add + LayerNorm,
embedding + LayerNorm, the K/V cache write, argmax over the vocabulary and the greedy step's tail,
and a whole decoder pass (prefill, steps, alignment) with the kernels against the torch ops.
GPU, or CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tristream.speech import kernels

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] if DEV == "cuda" else [torch.float32]


@pytest.fixture(autouse=True)
def _needs_triton() -> None:
    """Triton itself; the markers skip these tests without CUDA unless under TRITON_INTERPRET=1
    (tests/conftest.py)."""
    if not kernels.available():
        pytest.skip("needs Triton")


def _ln(d: int, dtype: torch.dtype, seed: int) -> nn.LayerNorm:
    g = torch.Generator().manual_seed(seed)
    ln = nn.LayerNorm(d)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.3 * torch.randn(d, generator=g))
        ln.bias.copy_(0.2 * torch.randn(d, generator=g))
    return ln.to(DEV, dtype)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 4e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 384, 80])
def test_add_layer_norm_equals_torch(dtype: torch.dtype, d: int) -> None:
    g = torch.Generator().manual_seed(d)
    x = (3 * torch.randn(4, 5, d, generator=g)).to(DEV, dtype)
    y = torch.randn(4, 5, d, generator=g).to(DEV, dtype)
    ln = _ln(d, dtype, d)
    with torch.inference_mode():
        s, h = kernels.add_layer_norm(x, y, ln)
        ws, wh = kernels.add_layer_norm_torch(x, y, ln)
    assert torch.equal(s, ws)  # the residual stream exactly
    torch.testing.assert_close(h, wh, **_tol(dtype))


def test_add_layer_norm_strided_rows() -> None:
    """A row-sliced residual (a prefill's last positions) is read through its row stride."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 64, generator=g).to(DEV)[:, 2:]
    y = torch.randn(3, 5, 64, generator=g).to(DEV)
    ln = _ln(64, torch.float32, 1)
    with torch.inference_mode():
        s, h = kernels.add_layer_norm(x, y, ln)
        ws, wh = kernels.add_layer_norm_torch(x, y, ln)
    assert torch.equal(s, ws)
    torch.testing.assert_close(h, wh, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared_pos", [True, False])
def test_embed_layer_norm_equals_torch(dtype: torch.dtype, shared_pos: bool) -> None:
    g = torch.Generator().manual_seed(3)
    tok_w = torch.randn(1000, 64, generator=g).to(DEV, dtype)
    pos_w = torch.randn(40, 64, generator=g).to(DEV, dtype)
    tokens = torch.randint(0, 1000, (3, 6), generator=g).to(DEV)
    pos = torch.arange(6).to(DEV) if shared_pos else torch.randint(0, 40, (3, 6), generator=g).to(DEV)
    ln = _ln(64, dtype, 3)
    with torch.inference_mode():
        x, h = kernels.embed_layer_norm(tokens, pos, tok_w, pos_w, ln)
        wx, wh = kernels.embed_layer_norm_torch(tokens, pos, tok_w, pos_w, ln)
    assert torch.equal(x, wx)
    torch.testing.assert_close(h, wh, **_tol(dtype))


@pytest.mark.parametrize("s_len", [1, 5])
def test_write_kv_equals_index_put(s_len: int) -> None:
    g = torch.Generator().manual_seed(s_len)
    b, heads, hd, t_max = 3, 4, 16, 12
    full = torch.randn(2, 5, heads, t_max, hd, generator=g).to(DEV)
    qkv = torch.randn(b, s_len, 3 * heads * hd, generator=g).to(DEV).view(b, s_len, 3, heads, hd)
    if s_len == 1:  # a step: each sequence at its own position
        pos = torch.tensor([[0], [7], [11]]).to(DEV)
    else:  # a prefill: shared positions
        pos = torch.arange(s_len).to(DEV)
    got, want = full[:, :b].clone(), full[:, :b].clone()  # a batch view of a larger cache
    kernels.write_kv(got, qkv, pos)
    kernels.write_kv_torch(want, qkv, pos)
    assert torch.equal(got, want)
    view = full.clone()
    kernels.write_kv(view[:, :b], qkv, pos)  # strided batch view: rows past b untouched
    assert torch.equal(view[:, b:], full[:, b:]) and torch.equal(view[:, :b], want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [51865, 1000, 1024, 7])
def test_argmax_equals_torch(dtype: torch.dtype, v: int) -> None:
    g = torch.Generator().manual_seed(v)
    x = torch.randn(9, v, generator=g).to(DEV, dtype)
    x[1, :] = 0.5  # all tied: first index
    x[2, v // 2] = x[2, v - 1] = 100.0  # ties across programs: the first
    x[3, -1] = float("nan")
    x[4, v // 3] = float("nan")
    x[4, v - 1] = float("nan")  # several NaN: the first
    x[5, :] = float("-inf")
    x[6, v - 1] = float("inf")
    x[7, 0] = 50.0
    assert torch.equal(kernels.argmax(x), x.argmax(-1))
    x3 = x.view(3, 3, v)
    assert torch.equal(kernels.argmax(x3), x3.argmax(-1))


def test_greedy_step_equals_torch() -> None:
    g = torch.Generator().manual_seed(5)
    b, v, n_prompt, k, t_max = 5, 3000, 4, 8, 16
    logits = torch.randn(b, v, generator=g).to(DEV)
    pos0 = torch.tensor([3, 6, 11, 15, 13]).to(DEV)  # column k (overflow) and the clamp at t_max - 1
    out0 = torch.randint(0, 100, (b, k + 1), generator=g).to(DEV)
    tok0 = torch.zeros(b, dtype=torch.long).to(DEV)
    got = (out0.clone(), tok0.clone(), pos0.clone())
    want = (out0.clone(), tok0.clone(), pos0.clone())
    kernels.greedy_step(logits, *got, n_prompt, k, t_max)
    kernels.greedy_step_torch(logits, *want, n_prompt, k, t_max)
    for a, w in zip(got, want, strict=True):
        assert torch.equal(a, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decoder_with_kernels_equals_torch_ops(dtype: torch.dtype, make_whisper) -> None:  # type: ignore[no-untyped-def]
    """Prefill (shared positions), one step per sequence at its own position, alignment logits, and
    the encoder: with the kernels, the torch path's logits and outputs (fp rounding), the same caches."""
    model = make_whisper().to(DEV, dtype)
    g = torch.Generator().manual_seed(7)
    b, p = 3, 6
    enc = torch.randn(b, 20, model.dims.d_model, generator=g).to(DEV, dtype)
    ids = torch.randint(0, 50000, (b, p), generator=g).to(DEV)
    mel = torch.randn(b, model.dims.n_mels, 40, generator=g).to(DEV, dtype)
    out = []
    with torch.inference_mode():
        for fused in (True, False):
            cache = model.new_cache(b, 20, 16, device=DEV, dtype=dtype)
            model.fill_cross(enc, cache)
            pre = model.decode(ids, torch.arange(p, device=DEV), cache, logits_from=p - 2, fused=fused)
            pos = torch.tensor([[p], [p - 2], [p + 3]], device=DEV)
            step = model.decode(ids[:, :1], pos, cache, vocab_limit=1000, fused=fused)
            al = model.alignment_logits(ids, cache, fused=fused)
            out.append((pre, step, al, cache.kv.clone(), model.encode(mel, fused=fused)))
    for a, w in zip(out[0], out[1], strict=True):
        torch.testing.assert_close(a, w, **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32
                                             else {"atol": 3e-2, "rtol": 1e-2}))


def test_runner_with_kernels_equals_torch_ops(make_whisper) -> None:  # type: ignore[no-untyped-def]
    """Whole passes (no draft, then drafts with a wrong token): the runner with the step kernels gives
    the torch runner's tokens, accepted drafts and word-time frames (eager here; graphed: GPU tests)."""
    import numpy as np

    from tristream.speech.config import WhisperTokens
    from tristream.speech.runner import WhisperRunner

    model = make_whisper().to(DEV)
    kw = dict(batch_buckets=(4,), audio_buckets_s=(2.0,), max_new_tokens=10, chunk=4, early_stop=False,
              max_draft=8, use_graphs=False)
    toks = WhisperTokens.for_vocab(51865)
    fused = WhisperRunner(model, toks, fused_kernels=True, **kw)  # type: ignore[arg-type]
    plain = WhisperRunner(model, toks, fused_kernels=False, **kw)  # type: ignore[arg-type]
    assert fused.fused_kernels and not plain.fused_kernels
    rng = np.random.default_rng(0)
    audio = [(0.1 * rng.standard_normal(32000 - 4000 * i)).astype(np.float32) for i in range(3)]
    a, b = fused.run(audio), plain.run(audio)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.frames, b.frames)
    drafts = [row[:8].tolist() for row in b.tokens]
    drafts[1][2] = (drafts[1][2] + 1) % 50000
    dfr = [row[:9].tolist() for row in b.frames]
    a, b = fused.run(audio, drafts, dfr), plain.run(audio, drafts, dfr)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.accepted, b.accepted)
    np.testing.assert_array_equal(a.frames, b.frames)
    assert a.accepted[1] <= 2 and a.steps == b.steps
