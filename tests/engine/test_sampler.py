"""On-device sampling: greedy, filters, penalties and seed reproducibility."""

from __future__ import annotations

import torch

from tristream.engine.sampler import SamplingBatch, apply_repetition_penalty, sample, uniform_noise
from tristream.engine.sequence import SamplingParams


def batch(params: list[SamplingParams], steps: list[int] | None = None, seeds: list[int] | None = None,
          hist: list[list[int]] | None = None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, steps or [0] * n, seeds or list(range(n)), hist, "cpu")


def test_greedy_and_degenerate_filters_equal_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    ps = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.8, top_p=1e-6),
          SamplingParams(temperature=0.0, top_k=5)]
    assert torch.equal(sample(logits, batch(ps)), logits.argmax(-1))


def test_seeded_sampling_is_independent_of_batch() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 100, generator=g)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=40)
    full = sample(logits, batch([p, p, p], steps=[3, 3, 3], seeds=[11, 12, 13]))
    alone = sample(logits[1:2], batch([p], steps=[3], seeds=[12]))
    assert full[1] == alone[0]
    again = sample(logits, batch([p, p, p], steps=[3, 3, 3], seeds=[11, 12, 13]))
    assert torch.equal(full, again)


def test_sampling_follows_the_distribution_and_filters() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 4000
    rows = logits.expand(n, 4).contiguous()
    t = sample(rows, batch([SamplingParams(temperature=1.0)] * n, steps=list(range(n)), seeds=[7] * n))
    counts = torch.bincount(t, minlength=4).float()
    t2 = sample(rows, batch([SamplingParams(temperature=1.0, top_k=2)] * n, steps=list(range(n)), seeds=[7] * n))
    counts_k2 = torch.bincount(t2, minlength=4).float()
    freq = counts / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    assert counts_k2[2:].sum() == 0 and abs(counts_k2[0] / n - 0.625) < 0.03


def test_noise_is_uniform() -> None:
    u = uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 5]), 20000)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])


def test_repetition_penalty() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1, 0]]), torch.tensor([2.0]))
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 1.0, 0.5]]))
    b = batch([SamplingParams(repetition_penalty=10.0)], hist=[[0]])
    assert int(sample(logits, b)[0]) == 2

