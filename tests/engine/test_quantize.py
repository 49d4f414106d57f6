"""Model-level quantisation: modes, the cache of quantised tensors, and refusals."""

from __future__ import annotations

import pytest
import torch

from tristream.engine.linear import native_kernels


def test_int4_and_int8_models_match_dense_and_reload_from_the_cache(tmp_path, monkeypatch) -> None:
    from tests.engine._tiny import tiny_hf_model
    from tristream.engine.loader import load_hf_folder
    from tristream.engine.quantize import quantize_model_cached

    if native_kernels() is None:
        pytest.skip("native kernels unavailable")
    monkeypatch.setenv("TRISTREAM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    tiny_hf_model("llama", folder)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    dense = load_hf_folder(folder)
    ref = torch.cat([dense.head()(x), dense.layers[0].gate_up(x)], dim=1)
    for mode in ("int8", "int4"):
        outs = []
        for _ in range(2):  # quantise (and cache), then load from the cache
            m = load_hf_folder(folder)
            quantize_model_cached(m, mode, folder)
            assert m.layers[0].gate_up.qformat == ("q4" if mode == "int4" else "q8")
            assert m.head().qformat == "q8"
            outs.append(torch.cat([m.head()(x), m.layers[0].gate_up(x)], dim=1))
        assert torch.equal(outs[0], outs[1])
        tol = 0.02 if mode == "int8" else 0.15  # random weights are far from a 4-bit grid
        assert float((outs[0] - ref).norm() / ref.norm()) < tol
    assert len(list((tmp_path / "cache" / "quant").glob("*.safetensors"))) == 2


def test_an_unknown_mode_is_refused() -> None:
    from tristream.engine.quantize import quantize_model

    with pytest.raises(ValueError, match="int8, int4"):
        quantize_model(None, "int3")  # type: ignore[arg-type]
