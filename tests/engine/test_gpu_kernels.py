"""Triton kernels against the torch reference (GPU; also runs under TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.interpret_ok]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _skip_without_triton() -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize("splits", [1, 4, 16])  # 16: splits past a short context are empty
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_decode_attention_matches_reference(splits: int, dtype: torch.dtype) -> None:
    _skip_without_triton()
    from tristream.engine.kernels.triton_ops import paged_decode_attention

    dev = _device()
    g = torch.Generator().manual_seed(splits)
    b, nh, nkv, hd, page, nblocks = 5, 8, 2, 64, 16, 64
    ctx = [1, 17, 100, 0, 250]  # a zero-length (padded) row must give zeros
    kc = torch.randn(nblocks * page, nkv, hd, generator=g).to(dev, dtype)
    vc = torch.randn(nblocks * page, nkv, hd, generator=g).to(dev, dtype)
    perm = torch.randperm(nblocks, generator=g)
    maxb = 16
    bt = torch.zeros(b, maxb, dtype=torch.int32)
    used = 0
    for i, c in enumerate(ctx):
        n = -(-c // page)
        bt[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    q = torch.randn(b, nh, hd, generator=g).to(dev, dtype)
    out = paged_decode_attention(q, kc, vc, bt.to(dev), torch.tensor(ctx, dtype=torch.int32, device=dev),
                                 page, hd ** -0.5, splits)
    for i, c in enumerate(ctx):
        if c == 0:
            assert torch.all(out[i] == 0)
            continue
        pos = torch.arange(c)
        slots = bt[i, pos // page].long() * page + pos % page
        k = kc[slots.to(dev)].double().repeat_interleave(nh // nkv, dim=1)  # [c, nh, hd]
        v = vc[slots.to(dev)].double().repeat_interleave(nh // nkv, dim=1)
        s = torch.einsum("hd,chd->hc", q[i].double(), k) * hd ** -0.5
        ref = torch.einsum("hc,chd->hd", s.softmax(-1), v)
        assert _rel(out[i], ref) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_rope_store_and_norms_match_torch() -> None:
    _skip_without_triton()
    from tristream.engine.kernels.triton_ops import add_rms_norm, rms_norm, rope_store, silu_mul
    from tristream.engine.models.llama import rms_norm as torch_rms
    from tristream.engine.rope import apply_rope, cos_sin_table

    dev = _device()
    g = torch.Generator().manual_seed(0)
    t, nh, nkv, hd = 4, 4, 2, 32
    cs = cos_sin_table(hd, 10000.0, None, 128).to(dev)
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=g).to(dev)
    pos = torch.tensor([0, 5, 77, 3], device=dev)
    slots = torch.tensor([3, -1, 9, 0], device=dev)
    kc = torch.full((16, nkv, hd), 7.0, device=dev)
    vc = torch.full((16, nkv, hd), 7.0, device=dev)
    q = rope_store(qkv, pos, cs, slots, kc, vc, nh, nkv, hd)
    c = cs[pos][:, None, : hd // 2]
    sn = cs[pos][:, None, hd // 2:]
    qr, kr, vr = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    assert _rel(q, apply_rope(qr.view(t, nh, hd), c, sn)) < 1e-6
    kref = apply_rope(kr.reshape(t, nkv, hd), c, sn)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert _rel(kc[s], kref[i]) < 1e-6 and _rel(vc[s], vr[i].view(nkv, hd)) < 1e-6
    written = set(x for x in slots.tolist() if x >= 0)
    untouched = [i for i in range(16) if i not in written]
    assert torch.all(kc[untouched] == 7.0) and torch.all(vc[untouched] == 7.0)  # padded slot wrote nowhere

    x = torch.randn(3, 100, generator=g).to(dev)
    r = torch.randn(3, 100, generator=g).to(dev)
    w = torch.randn(100, generator=g).to(dev)
    assert _rel(rms_norm(x, w, 1e-5), torch_rms(x, w, 1e-5)) < 1e-6
    y, res = add_rms_norm(x, r, w, 1e-5)
    assert _rel(res, x + r) < 1e-7 and _rel(y, torch_rms(x + r, w, 1e-5)) < 1e-6
    gu = torch.randn(3, 2 * 70, generator=g).to(dev)
    assert _rel(silu_mul(gu), torch.nn.functional.silu(gu[:, :70]) * gu[:, 70:]) < 1e-6


@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 64), (14, 2, 64), (4, 4, 32), (32, 8, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_attention_matches_reference(heads: tuple[int, int, int], dtype: torch.dtype) -> None:
    """Varlen causal prefill over a paged cache: chunks with and without a cached prefix,
    single-token chunks, chunks longer than one tile, block tables in shuffled order."""
    _skip_without_triton()
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("the Triton interpreter mishandles bf16")
    from tristream.engine.kernels.prefill_attention import block_m, paged_prefill_attention

    dev = _device()
    nh, nkv, hd = heads
    page, nblocks = 16, 96
    g = torch.Generator().manual_seed(nh * hd)
    kc = torch.randn(nblocks * page, nkv, hd, generator=g).to(dev, dtype)
    vc = torch.randn(nblocks * page, nkv, hd, generator=g).to(dev, dtype)
    chunks = [(5, 40), (1, 1), (70, 300), (3, 3), (33, 33), (1, 129)]  # (q_len, ctx_len)
    perm = torch.randperm(nblocks, generator=g).tolist()
    total = sum(q for q, _ in chunks)
    q = torch.randn(total, nh, hd, generator=g).to(dev, dtype)
    bm = block_m(nh // nkv)
    tile_chunk, tile_m0, q_start, q_len, ctx_len, bt_off, flat = [], [], [], [], [], [], []
    ref = torch.empty(total, nh, hd)
    used = start = 0
    for i, (ql, ctx) in enumerate(chunks):
        nb = -(-ctx // page)
        bt = perm[used:used + nb]
        used += nb
        bt_off.append(len(flat))
        flat += bt
        for m0 in range(0, ql, bm):
            tile_chunk.append(i)
            tile_m0.append(m0)
        q_start.append(start)
        q_len.append(ql)
        ctx_len.append(ctx)
        slots = torch.tensor([bt[p // page] * page + p % page for p in range(ctx)], device=dev)
        k = kc[slots].float().cpu().repeat_interleave(nh // nkv, 1)
        v = vc[slots].float().cpu().repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q[start:start + ql].float().cpu(), k) * hd ** -0.5
        allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - ql, ctx)[:, None]
        s = s.masked_fill(~allowed, float("-inf"))
        ref[start:start + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        start += ql

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=dev)

    out = paged_prefill_attention(q, kc, vc, t(tile_chunk), t(tile_m0), t(q_start), t(q_len), t(ctx_len),
                                  t(bt_off), t(flat), page, hd ** -0.5)
    assert _rel(out.cpu(), ref) < (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("shape", [(9, 3, 64, 576), (4, 4, 32, 1536), (14, 2, 64, 896)])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_rope_store1_equals_gemv_then_rope_store(shape: tuple[int, int, int, int], bias: bool) -> None:
    """The batch-1 fused norm+QKV+RoPE+store kernel against the two kernels it replaces: same q,
    same K/V cache rows, and a padded step (slot -1) writes nothing. K > 1024 takes several tiles."""
    _skip_without_triton()
    from tristream.engine.kernels.decode_fused import qkv_rope_store1
    from tristream.engine.kernels.gemv import fused_gemv
    from tristream.engine.kernels.triton_ops import rope_store
    from tristream.engine.rope import cos_sin_table

    dev = _device()
    nh, nkv, hd, k = shape
    g = torch.Generator().manual_seed(k + int(bias))
    n = (nh + 2 * nkv) * hd
    x = torch.randn(1, k, generator=g).to(dev)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dev)
    b = torch.randn(n, generator=g).to(dev) if bias else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dev)
    cs = cos_sin_table(hd, 10000.0, None, 256).to(dev)
    for slot in (5, -1):
        pos = torch.tensor([123], dtype=torch.int32, device=dev)
        slots = torch.tensor([slot], dtype=torch.int32, device=dev)
        kc, vc = torch.full((8, nkv, hd), 7.0, device=dev), torch.full((8, nkv, hd), 7.0, device=dev)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q = qkv_rope_store1(x, w, b, nw, 1e-5, pos, cs, slots, kc, vc, nh, nkv, hd)
        qkv = fused_gemv(x, w, bias=b, norm_weight=nw, eps=1e-5)
        q_ref = rope_store(qkv, pos, cs, slots, kc_ref, vc_ref, nh, nkv, hd)
        assert q.shape == (1, nh, hd)
        assert _rel(q, q_ref) < 1e-6
        assert _rel(kc, kc_ref) < 1e-6 and _rel(vc, vc_ref) < 1e-6
        if slot < 0:
            assert torch.all(kc == 7.0) and torch.all(vc == 7.0)
        else:
            assert not torch.all(kc[slot] == 7.0)


def test_qkv_rope_store1_refuses_bad_shapes() -> None:
    _skip_without_triton()
    from tristream.engine.kernels.decode_fused import qkv_rope_store1

    dev = _device()
    z = torch.zeros(1, dtype=torch.int32, device=dev)
    c = torch.zeros(4, 2, 8, device=dev)
    with pytest.raises(ValueError, match="batch-1"):
        qkv_rope_store1(torch.zeros(2, 16, device=dev), torch.zeros(32, 16, device=dev), None, None, 1e-5, z,
                        torch.zeros(8, 8, device=dev), z, c, c, 2, 1, 8)
    with pytest.raises(ValueError, match="weight rows"):
        qkv_rope_store1(torch.zeros(1, 16, device=dev), torch.zeros(30, 16, device=dev), None, None, 1e-5, z,
                        torch.zeros(8, 8, device=dev), z, c, c, 2, 1, 8)


@pytest.mark.parametrize("short_ctx", [None, 0, 16, 128])
@pytest.mark.parametrize("splits", [2, 16])
def test_paged_decode_attention_fused_merge_equals_the_merge_kernel(splits: int, short_ctx: int | None) -> None:
    """With merge counters the last split of each head merges the partials in the same kernel
    (only the splits that hold positions take part), and a context of at most `short_ctx`
    positions is done by one program per head: the output equals the two-kernel path, and the
    counters are back at zero for the next step (a second call, as the next graph replay, gives
    the same output). Contexts on both sides of every short_ctx, and one longer than 16 splits of
    the 64-position tile leave empty."""
    _skip_without_triton()
    from tristream.engine.kernels.triton_ops import paged_decode_attention

    dev = _device()
    g = torch.Generator().manual_seed(splits)
    b, nh, nkv, hd, page, nblocks = 6, 6, 2, 32, 16, 96
    ctx = [1, 150, 0, 17, 600, 128]
    kc = torch.randn(nblocks * page, nkv, hd, generator=g).to(dev)
    vc = torch.randn(nblocks * page, nkv, hd, generator=g).to(dev)
    bt = torch.randint(0, nblocks, (b, 40), generator=g, dtype=torch.int32).to(dev)  # 600 positions: 38 pages
    q = torch.randn(b, nh, hd, generator=g).to(dev)
    lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
    ref = paged_decode_attention(q, kc, vc, bt, lens, page, hd ** -0.5, splits)
    counters = torch.zeros(b * nh + 5, dtype=torch.int32, device=dev)
    first = None
    for _ in range(2):
        out = paged_decode_attention(q, kc, vc, bt, lens, page, hd ** -0.5, splits, counters=counters,
                                     short_ctx=short_ctx)
        assert _rel(out, ref) < 1e-6
        assert torch.all(out[2] == 0)  # the padded row
        assert torch.all(counters == 0)
        if first is not None:
            assert torch.equal(out, first)
        first = out
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, kc, vc, bt, lens, page, hd ** -0.5, splits, counters=counters[:3])
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, kc, vc, bt, lens, page, hd ** -0.5, splits, counters=counters, short_ctx=100)
