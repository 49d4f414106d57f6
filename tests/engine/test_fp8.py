"""FP8 (e4m3) weights on CPU: the quantise / dequantise reference, the Linear fp8 mode's torch path,
the loader's FP8 checkpoints (per tensor, per row and block scales) and an engine on fp8 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine._tiny import tiny_hf_model
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.linear import FP8_MAX, Linear, dequantize_fp8, fp8_reference, quantize_fp8
from tristream.engine.loader import load_model, read_safetensors
from tristream.engine.quantize import MODES, is_fp8
from tristream.engine.sequence import SamplingParams


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_quantize_fp8_rows_map_their_largest_magnitude_to_448() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(37, 96, generator=g) * torch.logspace(-3, 1, 37)[:, None]
    w[5] = 0.0
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (37,)
    amax = q.float().abs().amax(1)
    assert torch.equal(amax[torch.arange(37) != 5], torch.full((36,), FP8_MAX))
    assert s[5] == 1.0 and not q.float()[5].any()
    back = dequantize_fp8(q, s)
    # e4m3 keeps 3 mantissa bits: each element within half a step (2^-4 relative) of its value,
    # except near zero where the steps are absolute (the subnormals' 2^-9 times the scale)
    err = (back - w).abs()
    assert bool((err <= w.abs() * 2.0 ** -4 + s[:, None] * 2.0 ** -9 + 1e-12).all())
    assert 0.005 < _rel(back, w) < 0.04


def test_quantize_fp8_is_idempotent_on_its_own_grid() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    q, s = quantize_fp8(w)
    q2, s2 = quantize_fp8(dequantize_fp8(q, s))
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.allclose(s2, s, rtol=1e-6)


def test_linear_fp8_forward_is_the_reference_and_close_to_dense() -> None:
    g = torch.Generator().manual_seed(3)
    lin = Linear(48, 64, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0, 0.1, generator=g)
        lin.bias.normal_(0, 0.1, generator=g)  # type: ignore[union-attr]
    x = torch.randn(5, 64, generator=g)
    dense = lin(x)
    lin.quantize_fp8()
    assert lin.qformat == "fp8" and lin.weight.numel() == 0
    y = lin(x)
    ref = fp8_reference(x, lin.qtensors["w"], lin.qtensors["s"], lin.bias)
    assert torch.equal(y, ref)
    expect = x.double() @ dequantize_fp8(lin.qtensors["w"], lin.qtensors["s"]).double().T + lin.bias.double()  # type: ignore[union-attr]
    assert _rel(y, expect) < 1e-6
    assert _rel(y, dense) < 0.05
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        lin.set_fp8(torch.zeros(48, 64), torch.ones(48))


def test_fp8_reference_rounds_to_the_activation_dtype() -> None:
    q, s = quantize_fp8(torch.randn(32, 64, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y = fp8_reference(x, q, s)
    assert y.dtype == torch.bfloat16
    exact = (x.double() @ q.double().T) * s.double()
    assert _rel(y, exact) < 4e-3  # one bf16 rounding of float32 sums


def _save_fp8_checkpoint(src: Path, dst: Path, scales: str) -> dict[str, torch.Tensor]:
    """Re-save a dense HF checkpoint with its projection weights (and lm_head) as e4m3: scales
    'tensor' (one per weight), 'row' ([N, 1]) or 'block' (16 × 16 blocks, `weight_scale_inv`)."""
    from safetensors.torch import save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for name, t in read_safetensors(src).items():
        if not (name.endswith("_proj.weight") or name == "lm_head.weight"):
            out[name] = t.contiguous()
            continue
        w = t.float()
        prefix = name.removesuffix(".weight")
        if scales == "tensor":
            s = w.abs().max() / FP8_MAX
            out[name] = (w / s).to(torch.float8_e4m3fn)
            out[prefix + ".weight_scale"] = s.reshape(1)
        elif scales == "row":
            q, sr = quantize_fp8(w)
            out[name], out[prefix + ".weight_scale"] = q, sr[:, None].contiguous()
        else:
            n, k = w.shape
            b = 16  # ragged last blocks, as in checkpoints whose sizes are not multiples of 128
            nb, kb = -(-n // b), -(-k // b)
            pad = torch.zeros(nb * b, kb * b)
            pad[:n, :k] = w.abs()
            blocks = pad.view(nb, b, kb, b).amax((1, 3)).clamp(min=1e-12) / FP8_MAX
            full = blocks.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
            out[name] = (w / full).to(torch.float8_e4m3fn)
            out[prefix + ".weight_scale_inv"] = blocks.contiguous()
    save_file(out, str(dst / "model.safetensors"))
    return out


def _dense_twin(path: Path, tensors: dict[str, torch.Tensor], dst: Path) -> Path:
    """The same checkpoint with every e4m3 weight dequantised (float32)."""
    from safetensors.torch import save_file

    from tristream.engine.quantize import fp8_dequantize_tensor

    dst.mkdir()
    (dst / "config.json").write_text((path / "config.json").read_text())
    save_file({n: fp8_dequantize_tensor(n, tensors).contiguous() for n in tensors if "weight_scale" not in n},
              str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
def test_loader_reads_fp8_checkpoints(tmp_path: Path, scales: str) -> None:
    from tristream.engine.attention import AttnMetadata, TorchAttention

    tiny_hf_model("llama", tmp_path / "hf", seed=7)
    tensors = _save_fp8_checkpoint(tmp_path / "hf", tmp_path / "fp8", scales)
    model = load_model(tmp_path / "fp8")
    assert is_fp8(model)
    lin = model.layers[1].qkv
    assert lin.qformat == "fp8" and lin.qtensors["w"].dtype == torch.float8_e4m3fn
    assert model.lm_head is not None and model.lm_head.qformat == "fp8"
    dense = load_model(_dense_twin(tmp_path / "fp8", tensors, tmp_path / "dense"))
    if scales != "block":  # the file's codes, q|k|v concatenated in the model's order, and their scales
        parts = [tensors[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"]
        assert torch.equal(lin.qtensors["w"].view(torch.uint8), torch.cat(parts).view(torch.uint8))
        w = dequantize_fp8(lin.qtensors["w"], lin.qtensors["s"])
        assert torch.allclose(w, dense.layers[1].qkv.weight, rtol=1e-6, atol=0)
    else:  # block scales: the dequantised block values, re-quantised per row
        q, s = quantize_fp8(dense.layers[1].qkv.weight)
        assert torch.equal(lin.qtensors["w"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(lin.qtensors["s"], s)
    ids = torch.arange(3, 40)
    att = TorchAttention(model.cfg, model.cos_sin, AttnMetadata.dense(len(ids)), None, model.dtype)
    with torch.inference_mode():
        got = model.logits(model(model.embed(ids), att))
        ref = dense.logits(dense(dense.embed(ids), att))
    # per row: the same weights (float rounding apart); blocks: rounded to e4m3 twice (this tiny
    # random model's logits move 12% under one e4m3 rounding of its weights)
    assert _rel(got, ref) < (1e-5 if scales != "block" else 0.3)


def test_fp8_checkpoint_without_scales_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tiny_hf_model("llama", tmp_path / "hf", seed=8)
    tensors = _save_fp8_checkpoint(tmp_path / "hf", tmp_path / "fp8", "row")
    del tensors["model.layers.0.mlp.down_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(KeyError, match="weight_scale"):
        load_model(tmp_path / "fp8")


def test_engine_quant_fp8_generates_like_the_dequantised_dense_model(tmp_path: Path) -> None:
    """from_path(quant='fp8') equals, token for token, a dense engine over the same e4m3 weights
    dequantised (float32 on CPU, greedy), biases included; the tied head stays dense (the
    default: an e4m3 head costs perplexity)."""
    tiny_hf_model("qwen2", tmp_path / "hf", seed=9)  # q/k/v biases and a tied head
    assert "fp8" in MODES
    cfg = EngineConfig(block_size=4, num_blocks=64, max_model_len=128)
    eng = LLMEngine.from_path(tmp_path / "hf", quant="fp8", config=cfg)
    m = eng.model
    assert is_fp8(m) and m.head().qformat != "fp8" and m.lm_head is None
    dense = load_model(tmp_path / "hf")
    assert torch.equal(m.embed_tokens, dense.embed_tokens)  # the tied embedding stays dense for lookups
    with torch.no_grad():
        for a, b in zip(m.layers, dense.layers, strict=True):
            for name in ("qkv", "o", "gate_up", "down"):
                t = getattr(a, name).qtensors
                getattr(b, name).weight.copy_(dequantize_fp8(t["w"], t["s"]))
    ref_eng = LLMEngine(dense, None, EngineConfig(block_size=4, num_blocks=64, max_model_len=128))
    prompt = list(range(5, 25))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    got = eng.generate([prompt], params)[0]
    ref = ref_eng.generate([prompt], params)[0]
    assert got == ref
