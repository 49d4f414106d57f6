"""The log-mel's Triton tail (speech/mel.py: power + filterbank + log10, then the per-clip clamp and
scale) against its torch path and transformers' feature extractor, in both layouts and output
dtypes; and the torch path's own layout/dtype options. Triton tests: GPU, or CPU under
TRITON_INTERPRET=1."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tristream.speech import mel as mel_module
from tristream.speech.mel import LogMel

ATOL = 2e-3  # features are ~[-1, 2]


@pytest.fixture(scope="module")
def dev() -> Iterator[str]:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        yield "cuda"
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    # the interpreter's cost is per program: bigger tiles than the GPU's (another tiling, too)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mel_module, "BLOCK_T", 64)
        mp.setattr(mel_module, "MELS", 32)
        yield "cpu"


def _audio(kind: str, b: int, n: int, seed: int = 0) -> torch.Tensor:
    if kind == "noise":
        return torch.randn(b, n, generator=torch.Generator().manual_seed(seed)) * 0.1
    if kind == "sine":
        t = torch.arange(n, dtype=torch.float64) / 16000
        hz = 220.0 * torch.arange(1, b + 1, dtype=torch.float64)[:, None]
        return (0.5 * torch.sin(2 * math.pi * hz * t)).float()
    if kind == "silence":
        return torch.zeros(b, n)
    # one silent, one quiet and one loud clip: each clip's peak is its own
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(seed))
    return x * torch.tensor([0.0, 1e-3, 3.0])[:, None]


def _check(mel: LogMel, x: torch.Tensor, transpose: bool, out_dtype: torch.dtype) -> None:
    want = mel.forward_torch(x)
    if transpose:
        want = want.transpose(1, 2)
    got = mel(x, out_dtype=out_dtype, transpose=transpose)
    assert got.shape == want.shape and got.dtype == out_dtype and got.is_contiguous()
    assert (got.float() - want).abs().max().item() <= ATOL


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,b,n", [("noise", 1, 16000), ("noise", 3, 32077), ("sine", 2, 16000 * 3 + 5),
                                      ("silence", 2, 8000), ("mixed", 3, 20000), ("sine", 4, 1600)])
@pytest.mark.gpu
@pytest.mark.interpret_ok
def test_kernel_matches_torch_path(dev: str, kind: str, b: int, n: int, transpose: bool,
                                   out_dtype: torch.dtype) -> None:
    mel = LogMel(80).to(dev)
    mel.fused = True
    _check(mel, _audio(kind, b, n).to(dev), transpose, out_dtype)


@pytest.mark.gpu
@pytest.mark.interpret_ok
def test_kernel_on_long_clips_and_128_mels(dev: str) -> None:
    x = _audio("noise", 2, 480000 if dev == "cuda" else 80000, seed=3).to(dev)  # 30 s (5 s interpreted)
    _check(LogMel(80).to(dev), x, False, torch.float32)
    _check(LogMel(128).to(dev), x, True, torch.float16)


@pytest.mark.gpu
@pytest.mark.interpret_ok
def test_kernel_matches_feature_extractor(dev: str) -> None:
    transformers = pytest.importorskip("transformers")
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    audio = (np.random.default_rng(0).standard_normal(16000 * 2) * 0.1).astype(np.float32)
    want = fe(audio, sampling_rate=16000, return_tensors="np").input_features[0]
    padded = np.zeros(480000, np.float32)
    padded[: audio.size] = audio
    got = LogMel(80).to(dev)(torch.from_numpy(padded)[None].to(dev))[0].cpu().numpy()
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_torch_path_layout_and_dtype() -> None:
    mel = LogMel(80)
    mel.fused = False
    x = _audio("noise", 2, 16000 + 99)
    base = mel(x)
    assert base.shape == (2, 80, 100) and base.dtype == torch.float32
    assert torch.equal(base, mel.forward_torch(x))
    t = mel(x, out_dtype=torch.float16, transpose=True)
    assert t.shape == (2, 100, 80) and t.dtype == torch.float16 and t.is_contiguous()
    assert torch.equal(t, base.transpose(1, 2).half())


def test_kernels_switched_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRISTREAM_WHISPER_KERNELS", "0")
    assert not LogMel(80).fused
    monkeypatch.setenv("TRISTREAM_WHISPER_KERNELS", "1")
    assert LogMel(80).fused
