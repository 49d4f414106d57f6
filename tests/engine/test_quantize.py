"""Weight-only int8 / int4 linear layers against the dense product."""

from __future__ import annotations

import torch


def test_int4_and_int8_linear_match_dense() -> None:
    from tristream.engine.linear import Linear

    g = torch.Generator().manual_seed(3)
    lin = Linear(96, 128)
    # a Q4_1-like grid: each group of 32 spans codes 0..15 exactly, as llama.cpp's quantiser makes it
    d = torch.rand(96, 4, 1, generator=g) * 0.1
    m = -torch.rand(96, 4, 1, generator=g)
    codes = torch.randint(0, 16, (96, 4, 32), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15
    w = (m + d * codes).view(96, 128)
    lin.weight.data.copy_(w)
    x = torch.randn(5, 128, generator=g)
    ref = x @ w.t()
    q8 = Linear(96, 128)
    q8.weight.data.copy_(w)
    q8.quantize_int8()
    lin.quantize_int4()
    for q in (lin, q8):
        err = float((q(x) - ref).norm() / ref.norm())
        assert err < 1e-2
