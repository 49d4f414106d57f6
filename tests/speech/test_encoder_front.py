"""The encoder's GEMM front (`Whisper._conv_gemms`: both convolutions as im2col GEMMs) equals the
cuDNN/torch convolutions, and the many-rows / position-table forms of `kernels.add_layer_norm`
equal torch's add + LayerNorm."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tristream.speech.config import WhisperDims
from tristream.speech.kernels import gelu_linear
from tristream.speech.whisper import Whisper


def _model(seed: int = 0) -> Whisper:
    torch.manual_seed(seed)
    m = Whisper(WhisperDims(64, 2, 2, 4, 128, n_mels=16, vocab_size=300, max_source_positions=64,
                            max_target_positions=32))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    return m.eval()


@pytest.mark.parametrize("frames", [2, 10, 64])
def test_conv_gemms_equal_the_convolutions(frames: int) -> None:
    m = _model()
    mel = torch.randn(3, 16, frames)
    ref = F.gelu(m.conv2(F.gelu(m.conv1(mel)))).transpose(1, 2)
    got = m._conv_gemms(mel)
    assert got.shape == ref.shape == (3, frames // 2, 64)
    assert float((got - ref).abs().max()) < 1e-5


def test_conv_weights_are_remade_when_the_weights_change() -> None:
    m = _model()
    mel = torch.randn(2, 16, 8)
    m._conv_gemms(mel)
    with torch.no_grad():
        m.conv1.weight.mul_(2.0)
    ref = F.gelu(m.conv2(F.gelu(m.conv1(mel)))).transpose(1, 2)
    assert float((m._conv_gemms(mel) - ref).abs().max()) < 1e-5


def test_gelu_linear_is_exact_off_cuda() -> None:
    x, w, b = torch.randn(5, 7, 16), torch.randn(32, 16), torch.randn(32)
    assert torch.allclose(gelu_linear(x, w, b), F.gelu(F.linear(x, w, b)), atol=1e-6)


@pytest.fixture()
def interp() -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.gpu
@pytest.mark.interpret_ok
@pytest.mark.parametrize("rows", [None, (1, 1), (8, 4), (16, 8)])
@pytest.mark.parametrize("shape", [(3, 5, 48), (2, 300, 40)])
def test_add_layer_norm_rows_and_position_table(interp: None, rows: tuple[int, int] | None,
                                                shape: tuple[int, int, int]) -> None:
    from tristream.speech import kernels

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1)
    ln = torch.nn.LayerNorm(shape[-1]).to(dev)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x, y = torch.randn(shape, device=dev), torch.randn(shape, device=dev)
    with torch.no_grad():
        _check_add_ln(kernels, x, y, ln, rows)


def _check_add_ln(kernels: object, x: torch.Tensor, y: torch.Tensor, ln: torch.nn.LayerNorm,
                  rows: tuple[int, int] | None) -> None:
    dev = x.device
    shape = tuple(x.shape)
    s, h = kernels.add_layer_norm(x, y, ln, rows=rows)  # type: ignore[attr-defined]
    assert float((s - (x + y)).abs().max()) < 1e-6 and float((h - ln(x + y)).abs().max()) < 1e-4
    pos = torch.randn(shape[1:], device=dev)  # [T, D]: added to every sequence
    s, h = kernels.add_layer_norm(x, pos, ln, rows=rows)  # type: ignore[attr-defined]
    assert float((s - (x + pos)).abs().max()) < 1e-6 and float((h - ln(x + pos)).abs().max()) < 1e-4
