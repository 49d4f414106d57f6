"""The native CPU kernels (tristream/engine/cpu) against float32 references of the same weights."""

from __future__ import annotations

import pytest
import torch

from tristream.engine.cpu import native
from tristream.engine.linear import Linear, dequantize_blocks, native_kernels, quantize_blocks


@pytest.fixture(scope="module", autouse=True)
def kernels() -> native.Kernels:
    k = native_kernels()
    if k is None:
        pytest.skip(f"native kernels unavailable: {native.last_error()}")
    return k


def _linear(n: int, k: int, fmt: str, bias: bool = False, seed: int = 0) -> tuple[Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(n, k, bias=bias)
    lin.weight.data.copy_(torch.randn(n, k, generator=g))
    if bias:
        lin.bias.data.copy_(torch.randn(n, generator=g))
    lin.quantize(fmt)
    return lin, dequantize_blocks(fmt, lin.qtensors)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (1, 64, 7), (3, 96, 33), (4, 1536, 64), (13, 128, 50), (64, 576, 96)])
def test_quantised_linear_equals_the_float_product_of_its_weights(fmt: str, m: int, k: int, n: int) -> None:
    lin, w = _linear(n, k, fmt, bias=n % 2 == 1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 3
    ref = x.double() @ w.double().t()
    if lin.bias is not None:
        ref = ref + lin.bias.double()
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-4


def test_results_are_float32_not_rounded_to_bf16() -> None:
    """The output head decides greedy tokens: logits rounded to bf16 tie (steps of 0.125 near 25),
    and the lowest id won such ties on the earlier int8/int4 path."""
    lin, w = _linear(4096, 576, "q8")
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(2)) * 2
    y = lin(x)
    ref = x @ w.t()
    assert float((y - ref).abs().max()) < 1e-3 * float(ref.abs().max())
    on_bf16_grid = float((y.bfloat16().float() == y).float().mean())
    assert on_bf16_grid < 0.05
    assert len(torch.unique(y)) > 0.99 * y.numel()


def test_a_row_does_not_depend_on_the_rows_beside_it() -> None:
    """Chunked prefill and prefix-cache hits must compute a position exactly as a whole prompt does."""
    lin, _ = _linear(96, 576, "q4")
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(3))
    whole = lin(x)
    for i in range(11):
        assert torch.equal(lin(x[i:i + 1]), whole[i:i + 1])
    assert torch.equal(lin(x[3:9]), whole[3:9])


def test_gguf_grids_are_recovered_exactly() -> None:
    """Weights on a Q4_1 / Q8_0 grid (fp16 scale and minimum per 32) quantise back to themselves."""
    g = torch.Generator().manual_seed(4)
    n, k = 16, 128
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.05 + 1e-3).half().float()
    mn = (-torch.rand(n, k // 32, 1, generator=g)).half().float()
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15
    w4 = (codes * d + mn).view(n, k)
    assert torch.equal(dequantize_blocks("q4", quantize_blocks(w4, "q4")), w4)
    c8 = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    c8[..., 0] = 127
    w8 = (c8 * d).view(n, k)
    assert torch.equal(dequantize_blocks("q8", quantize_blocks(w8, "q8")), w8)


def test_bad_shapes_and_formats_are_refused() -> None:
    lin = Linear(8, 40)
    with pytest.raises(ValueError, match="multiple of"):
        lin.quantize("q4")
    with pytest.raises(ValueError, match="q4, q8"):
        Linear(8, 64).quantize("q3")


def test_native_elementwise_ops_equal_torch() -> None:
    from tristream.engine.cpu.ops import NativeOps
    from tristream.engine.models.llama import TorchOps

    ops = NativeOps(native_kernels())
    g = torch.Generator().manual_seed(5)
    for rows in (1, 5, 300):
        x, r, w = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g), torch.rand(576, generator=g)
        n1, s1 = ops.add_rms_norm(x.clone(), r, w, 1e-5)
        n2, s2 = TorchOps.add_rms_norm(x, r, w, 1e-5)
        assert torch.allclose(n1, n2, atol=1e-5) and torch.equal(s1, s2)
        assert torch.allclose(ops.rms_norm(x, w, 1e-5), TorchOps.rms_norm(x, w, 1e-5), atol=1e-5)
        gu = torch.randn(rows, 2 * 1536, generator=g) * 8
        assert torch.allclose(ops.silu_mul(gu), TorchOps.silu_mul(gu), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quant", [None, "int4"])
def test_native_decode_step_equals_the_torch_reference(tmp_path, monkeypatch, quant) -> None:
    """A tiny random model through the engine: the native decode step (rope, cache write and
    attention over the paged cache; with quantised weights every layer in one call) gives the
    torch backend's logits, batch of 3 included."""
    from tests.engine._tiny import tiny_hf_model
    from tristream.engine.engine import EngineConfig, LLMEngine
    from tristream.engine.sequence import SamplingParams

    monkeypatch.setenv("TRISTREAM_CACHE", str(tmp_path / "cache"))
    tiny_hf_model("qwen2", tmp_path)  # attention biases exercise the bias path
    logits = {}
    for native_on in (True, False):
        eng = LLMEngine.from_path(tmp_path, quant=quant, config=EngineConfig(block_size=4, num_blocks=64))
        if native_on and quant:
            assert eng.runner._native_decoder() is not None
        if not native_on:
            eng.runner.native = None
        seen: list[torch.Tensor] = []
        orig = eng.model.logits

        def keep(h: torch.Tensor, orig=orig, seen=seen) -> torch.Tensor:
            out = orig(h)
            seen.append(out.clone())
            return out

        eng.model.logits = keep
        eng.generate([[5, 6, 7, 8, 9], [10, 11], list(range(20, 37))], SamplingParams(max_tokens=12, ignore_eos=True))
        logits[native_on] = seen
    assert len(logits[True]) == len(logits[False])
    for i, (a, b) in enumerate(zip(logits[True], logits[False], strict=True)):
        assert a.shape == b.shape, i
        err = float((a - b).abs().max() / b.abs().max())
        # float32 paths that sum in another order; with quantised weights a last-bit change can
        # also move an activation across an s16 rounding step (1/65534 of its block's range)
        assert err < (1e-3 if quant else 1e-5), f"step {i}: max relative diff {err:.2e}"


def test_isa_choice_follows_the_cpu_and_the_environment() -> None:
    avx2 = {"avx2", "fma", "f16c"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert native.best_isa(avx512, {}) == "avx512vnni"
    assert native.best_isa(avx2, {}) == "avx2"
    assert native.best_isa({"sse4_2"}, {}) is None
    assert native.best_isa(avx512, {"ATEN_CPU_CAPABILITY": "avx2"}) == "avx2"
    assert native.best_isa(avx512, {"ATEN_CPU_CAPABILITY": "default"}) is None
    assert native.best_isa(avx512, {native.ISA_ENV: "avx2"}) == "avx2"
    assert native.best_isa(avx512, {native.ISA_ENV: "none"}) is None
    with pytest.raises(native.UnsupportedCPU, match="lacks avx512_vnni"):
        native.best_isa(avx2 | {"avx512f", "avx512bw", "avx512vl"}, {native.ISA_ENV: "avx512vnni"})
    with pytest.raises(native.UnsupportedCPU, match="must be one of"):
        native.best_isa(avx2, {native.ISA_ENV: "neon"})


def test_the_engine_factory_refuses_user_mistakes_in_one_line(tmp_path, monkeypatch) -> None:
    from tristream.engine.cli_support import ModelNotFound, ModelSetupError, load_engine, resolve_quant

    with pytest.raises(ModelSetupError, match="--quant must be one of auto, none, int8, int4, fp8, not 'int3'"):
        load_engine(None, "cpu", "int3")
    with pytest.raises(ModelSetupError, match="--quant fp8 is for CUDA GPUs; on cpu use --quant auto"):
        load_engine(None, "cpu", "fp8")
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ModelSetupError, match="not a model this engine can load"):
        load_engine(str(junk), "cpu", "none")
    with pytest.raises(ModelNotFound, match="no such file"):
        load_engine(str(tmp_path / "missing.gguf"), "cpu", "none")
    monkeypatch.setenv(native.ISA_ENV, "avx512vnni")
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    with pytest.raises(ModelSetupError, match="lacks"):
        load_engine(None, "cpu", "int4")
    with pytest.raises(ModelSetupError, match="for CPU inference"):
        resolve_quant("int4", "cuda")
