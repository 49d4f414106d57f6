"""The capture-time check that keeps a decode kernel variant only when it agrees with cuBLAS."""

from __future__ import annotations

import torch

from tristream.engine.kernel_choice import variant_agrees


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_small_error_agrees_even_when_a_near_tie_flips() -> None:
    ref = torch.tensor([[1.0, 0.999, -2.0, 0.5]])
    got = torch.tensor([[0.999, 1.0, -2.0, 0.5]])  # the argmax flips on a near-tie
    assert _rel(got, ref) < 2e-2
    assert variant_agrees(got, ref, _rel(got, ref))


def test_rounding_drift_agrees_only_with_the_same_greedy_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 512, generator=g)
    ref[:, 7] = 10.0  # a clear winner in every row
    drift = ref * (1 + 0.04 * torch.randn(2, 512, generator=g))
    err = _rel(drift, ref)
    assert 2e-2 < err < 6e-2
    assert variant_agrees(drift, ref, err)
    flipped = drift.clone()
    flipped[1, 7] = -10.0  # same size of error budget, but row 1 would sample another token
    assert not variant_agrees(flipped, ref, 4e-2)


def test_a_wrong_kernel_is_rejected() -> None:
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(1, 256, generator=g)
    wrong = ref.roll(3, dims=-1)  # e.g. a bad rotation: same values, wrong places
    assert not variant_agrees(wrong, ref, _rel(wrong, ref))
