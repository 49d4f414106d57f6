"""The batch-1 attention + O + residual kernel (`kernels/decode_attn_o.py`) against a float32
reference on paged caches, on both of its paths (short context, merged splits), and bitwise
reproducible. GPU, or CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]


@pytest.fixture(scope="module")
def dev() -> str:
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return "cuda" if torch.cuda.is_available() else "cpu"


def _case(dev: str, ctx: int, nh: int = 4, nkv: int = 2, hd: int = 16, hidden: int = 48, page: int = 4,
          dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n_pages = 64
    perm = torch.randperm(n_pages, generator=g)  # a scattered block table
    kc = torch.randn(n_pages * page, nkv, hd, generator=g).to(dev, dtype)
    vc = torch.randn(n_pages * page, nkv, hd, generator=g).to(dev, dtype)
    return {"q": torch.randn(1, nh, hd, generator=g).to(dev, dtype), "kc": kc, "vc": vc,
            "bt": perm[None, :].to(dev, torch.int32).contiguous(), "ctx": torch.tensor([ctx], dtype=torch.int32,
                                                                                     device=dev),
            "w": (torch.randn(hidden, nh * hd, generator=g) / (nh * hd) ** 0.5).to(dev, dtype),
            "res": torch.randn(1, hidden, generator=g).to(dev, dtype), "perm": perm}


def _run(c: dict[str, torch.Tensor], splits: int, short: int, page: int = 4, block_o: int = 16) -> torch.Tensor:
    from tristream.engine.kernels.decode_attn_o import FX_ONE, attn_o_b1

    hidden = c["w"].shape[0]
    acc = torch.zeros(hidden, dtype=torch.int64, device=c["q"].device)
    counters = torch.zeros(c["q"].shape[1], dtype=torch.int32, device=c["q"].device)
    attn_o_b1(c["q"], c["kc"], c["vc"], c["bt"], c["ctx"], page, c["q"].shape[-1] ** -0.5, splits, counters,
              c["w"], c["res"], acc, short_ctx=short, block_o=block_o)
    assert int(counters.abs().sum()) == 0  # the merging splits reset their counters
    return acc.double() / FX_ONE


def _reference(c: dict[str, torch.Tensor], page: int = 4) -> torch.Tensor:
    from tristream.engine.kernels.decode_attn_o import attn_o_reference

    n = int(c["ctx"][0])
    pos = torch.arange(n)
    slots = (c["perm"][pos // page] * page + pos % page).to(c["kc"].device)
    return attn_o_reference(c["q"], c["kc"][slots], c["vc"][slots], c["w"], c["res"], c["q"].shape[-1] ** -0.5)


@pytest.mark.parametrize("ctx", [1, 5, 16, 17, 40, 130])
def test_attn_o_equals_the_reference_on_both_paths(dev: str, ctx: int) -> None:
    c = _case(dev, ctx)
    got = _run(c, splits=4, short=16)  # ≤ 16: one program per (head, column block); above: 4 splits
    ref = _reference(c).double()
    assert float((got.view(1, -1) - ref).abs().max()) < 1e-4


def test_attn_o_sums_do_not_depend_on_order(dev: str) -> None:
    """Integer atomics: the same inputs give the same bits, whichever program adds first (the
    rerun); and a column tile that is not a multiple of the hidden size leaves nothing out."""
    for ctx in (9, 33):
        c = _case(dev, ctx, hidden=40, seed=3)
        a, b = _run(c, splits=4, short=16, block_o=16), _run(c, splits=4, short=16, block_o=32)
        # another tile shape may sum a row's HD products in another order (float32 rounding)
        assert float((a - b).abs().max()) < 1e-6
        assert float((a.view(1, -1) - _reference(c).double()).abs().max()) < 1e-4
        assert torch.equal(_run(c, splits=4, short=16), a)


def test_attn_o_refuses_bad_arguments(dev: str) -> None:
    from tristream.engine.kernels.decode_attn_o import attn_o_b1

    c = _case(dev, 4)
    acc = torch.zeros(48, dtype=torch.int64, device=c["q"].device)
    cnt = torch.zeros(4, dtype=torch.int32, device=c["q"].device)
    args = (c["q"], c["kc"], c["vc"], c["bt"], c["ctx"], 4, 0.25)
    with pytest.raises(ValueError, match="splits"):
        attn_o_b1(*args, 1, cnt, c["w"], c["res"], acc)
    with pytest.raises(ValueError, match="int64"):
        attn_o_b1(*args, 4, cnt, c["w"], c["res"], acc.float())
    with pytest.raises(ValueError, match="short_ctx"):
        attn_o_b1(*args, 4, cnt, c["w"], c["res"], acc, short_ctx=24)
    with pytest.raises(ValueError, match="batch-1"):
        attn_o_b1(c["q"].expand(2, -1, -1).contiguous(), *args[1:], 4, cnt, c["w"], c["res"], acc)
