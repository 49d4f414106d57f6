"""CUDA graph replay equals eager decode at every bucket; Triton decode equals the torch path."""

from __future__ import annotations

import pytest
import torch

from tests.engine._tiny import random_llama_cuda
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.kernel_choice import B1_VARIANTS
from tristream.engine.models.llama import LlamaModel
from tristream.engine.runner import PrefillChunk
from tristream.engine.sequence import SamplingParams

pytestmark = pytest.mark.gpu

BUCKETS = (1, 2, 4, 8, 16, 32)


def _model(dtype: torch.dtype, qwen: bool = False) -> LlamaModel:
    return random_llama_cuda(dtype, attention_bias=qwen)


def _running_engine(model: LlamaModel, n: int, kernels: str = "auto") -> LLMEngine:
    eng = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=1024, max_model_len=1024,
                                              graph_buckets=BUCKETS, max_prefill_tokens=4096,
                                              decode_kernels=kernels,
                                              overlap=False))  # the tests drive the decoder: no step in flight
    eng.runner.capture()
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        length = int(torch.randint(1, 400, (1,), generator=g))
        eng.add_request(torch.randint(3, model.cfg.vocab_size, (length,), generator=g).tolist(),
                        SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert all(s.is_decode for s in eng.seqs.values()) and len(eng.seqs) == n
    for s in eng.seqs.values():  # the pending token's block, as a step would allocate it
        assert eng._ensure_blocks(s, len(s.keys), set())
    return eng


@pytest.mark.parametrize("kernels", ["b1_hc", "cublas"])
def test_graph_replay_equals_eager_at_every_bucket(kernels: str) -> None:
    model = _model(torch.bfloat16)
    eng = _running_engine(model, BUCKETS[-1], kernels)
    dec = eng.runner.decoder
    assert dec is not None and set(dec.graphs) == set(BUCKETS)
    seqs = list(eng.seqs.values())
    sizes = sorted({b for b in BUCKETS} | {b - 1 for b in BUCKETS if b > 2} | {3})
    for n in sizes:
        graph = dec.run(seqs[:n]).clone()  # replay of the smallest bucket ≥ n (padded rows)
        dec.prepare(seqs[:n], dec.bucket_for(n) or n)  # the replay left its tokens in the input ids
        eager = dec.forward(dec.bucket_for(n) or n)[:n]  # same persistent inputs, no graph
        torch.cuda.synchronize()
        assert torch.isfinite(graph).all()
        assert torch.equal(graph, eager), f"bucket for {n} rows differs"
        # the graph's own argmax (on the head's bf16 logits): its tokens, also written as the next input ids
        toks = dec.run_greedy(seqs[:n]).clone()
        torch.cuda.synchronize()
        assert torch.equal(toks, graph.argmax(-1)), f"bucket for {n} rows: in-graph tokens differ"
        assert torch.equal(dec.ids[:n].long(), toks)


@pytest.mark.parametrize("qwen", [False, True])
def test_triton_decode_equals_torch_reference(qwen: bool) -> None:
    model = _model(torch.float32, qwen)
    eng = _running_engine(model, 5, "cublas")  # 5 rows: bucket 8 (bucket 1's variants: the test below)
    seqs = list(eng.seqs.values())
    got = eng.runner.decoder.run(seqs).clone()
    eng.runner.packed = False  # the per-sequence torch attention path is the reference
    ref = eng.runner.prefill([PrefillChunk(s, len(s.keys) - 1, 1, True) for s in seqs])
    assert ref is not None
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("kernels", B1_VARIANTS)
@pytest.mark.parametrize("qwen", [False, True])
def test_batch1_fused_layer_equals_torch_reference_and_its_graph(qwen: bool, kernels: str) -> None:
    """Bucket 1 through the norm+QKV+RoPE+store kernel (with and without PDL): logits equal the
    torch reference (fp32), the captured graph equals its eager run (bf16), and the K/V it wrote
    let the next steps decode the same tokens as the cuBLAS path."""
    if "_pdl" in kernels and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or newer")
    model = _model(torch.float32, qwen)
    eng = _running_engine(model, 1, kernels)
    dec = eng.runner.decoder
    assert dec is not None and dec.variant_for(1) == kernels
    seqs = list(eng.seqs.values())
    got = dec.run(seqs).clone()
    eng.runner.packed = False
    ref = eng.runner.prefill([PrefillChunk(s, len(s.keys) - 1, 1, True) for s in seqs])
    assert ref is not None
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4

    model16 = _model(torch.bfloat16, qwen)
    eng16 = _running_engine(model16, 1, kernels)
    d16 = eng16.runner.decoder
    graph = d16.run(list(eng16.seqs.values())).clone()
    d16.prepare(list(eng16.seqs.values()), 1)  # the replay left its tokens in the input ids
    eager = d16.forward(1)
    torch.cuda.synchronize()
    assert torch.equal(graph, eager)

    tokens = {}
    for k in (kernels, "cublas"):  # fp32: rounding cannot flip a greedy token
        e = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=256, max_model_len=1024,
                                                  graph_buckets=(1, 2), decode_kernels=k))
        e.runner.capture()
        out = e.generate([list(range(3, 40))], SamplingParams(max_tokens=24, ignore_eos=True))
        tokens[k] = out[0]
    assert tokens[kernels] == tokens["cublas"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_gemv_matches_torch(dtype: torch.dtype) -> None:
    import torch.nn.functional as F

    from tristream.engine.kernels.gemv import fused_gemv
    from tristream.engine.models.llama import rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    for n, k in [(960, 576), (2048, 8192), (5000, 300)]:
        x, w, b, r, nw = rnd(1, k), rnd(n, k), rnd(n), rnd(1, n), rnd(k)
        assert rel(fused_gemv(x, w, bias=b, norm_weight=nw, eps=1e-5), F.linear(rms_norm(x, nw, 1e-5), w, b)) < tol
        assert rel(fused_gemv(x, w, residual=r), r + F.linear(x, w)) < tol
        gu = rnd(1, 2 * k)
        ref = r + F.linear(F.silu(gu[:, :k]) * gu[:, k:], w)
        assert rel(fused_gemv(gu, w, residual=r, silu=True), ref) < tol
