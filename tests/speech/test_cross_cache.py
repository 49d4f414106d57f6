"""The fused cross K|V cache: one GEMM fills it, bucket views keep stream rows in place, the
encoder's residual stream stays contiguous (CPU)."""

from __future__ import annotations

import torch

from tristream.speech.whisper import Whisper


def test_fill_cross_direct_gemm_equals_per_layer_projection(tiny_whisper: Whisper) -> None:
    m = tiny_whisper
    enc = torch.randn(3, 20, m.dims.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = m.new_cache(3, 20, 8)  # [3, 20, ...]: the GEMM writes the buffer itself
        m.fill_cross(enc, exact)
        wider = m.new_cache(4, 20, 8)  # more rows than enc: projected, then copied into the first 3
        m.fill_cross(enc, wider)
        hd, h = m.dims.head_dim, m.dims.heads
        for i in range(m.dims.decoder_layers):
            w = m.xkv.weight.view(m.dims.decoder_layers, 2, -1, m.dims.d_model)[i]
            b = m.xkv.bias.view(m.dims.decoder_layers, 2, -1)[i]
            for j, got in enumerate(exact.cross(i)):
                want = (enc @ w[j].T + b[j]).view(3, 20, h, hd).transpose(1, 2)
                torch.testing.assert_close(got, want)
                torch.testing.assert_close(wider.cross(i)[j][:3], want)


def test_bucket_views_keep_stream_rows_in_place(tiny_whisper: Whisper) -> None:
    """For one encoder length, row r of a smaller batch view is row r of a larger one (the runner
    moves rows to the front for a smaller alignment bucket and relies on it)."""
    cache = tiny_whisper.new_cache(8, 30, 8)
    big, small = cache.rows(8, 12), cache.rows(2, 12)
    big.xkv.copy_(torch.randn(big.xkv.shape, generator=torch.Generator().manual_seed(1)))
    assert big.xkv.is_contiguous() and small.xkv.is_contiguous()
    torch.testing.assert_close(small.xkv, big.xkv[:2], rtol=0, atol=0)
    assert small.xkv.data_ptr() == big.xkv.data_ptr() == cache.xflat.data_ptr()


def test_encoder_residual_stream_is_contiguous(tiny_whisper: Whisper) -> None:
    seen: list[bool] = []
    hooks = [layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].is_contiguous()))
             for layer in tiny_whisper.enc_layers]
    try:
        with torch.no_grad():
            tiny_whisper.encode(torch.randn(2, 80, 60))
    finally:
        for hk in hooks:
            hk.remove()
    assert seen == [True] * len(tiny_whisper.enc_layers)
