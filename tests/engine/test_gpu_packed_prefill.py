"""GPU: batched prefill (Triton rope/cache store + one SDPA per group) equals the per-sequence path."""

from __future__ import annotations

import pytest
import torch

from tests.engine._tiny import random_llama_cuda
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.models.llama import LlamaModel
from tristream.engine.runner import PrefillChunk
from tristream.engine.sequence import Sequence

pytestmark = pytest.mark.gpu


def _model(dtype: torch.dtype) -> LlamaModel:
    return random_llama_cuda(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_prefill_equals_per_sequence_reference_on_gpu(dtype: torch.dtype) -> None:
    model = _model(dtype)
    g = torch.Generator().manual_seed(2)
    lengths = [300, 2, 97, 1, 40, 513, 16, 5]
    prefix = [0, 1, 64, 0, 17, 200, 15, 3]
    prompts = [torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    engines = [LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=512, packed_prefill=p,
                                                   use_graphs=False)) for p in (True, False)]
    seqs: list[list[Sequence]] = []
    for eng in engines:
        ss = []
        for p in prompts:
            s = Sequence(keys=list(p))
            s.block_table = [eng.blocks.allocate() for _ in range(-(-len(p) // 16))][::-1]
            ss.append(s)
        seqs.append(ss)
        for s, k in zip(ss, prefix, strict=True):
            if k:
                eng.runner.prefill([PrefillChunk(s, 0, k, False)])
    got = engines[0].runner.prefill([PrefillChunk(s, k, n - k, True)
                                     for s, k, n in zip(seqs[0], prefix, lengths, strict=True)])
    assert got is not None
    tol = 1e-3 if dtype == torch.float32 else 5e-2  # bf16: rope rounds differently in the two paths
    for i, (s, k, n) in enumerate(zip(seqs[1], prefix, lengths, strict=True)):
        ref = engines[1].runner.prefill([PrefillChunk(s, k, n - k, True)])
        assert ref is not None
        err = float((got[i] - ref[0]).norm() / ref[0].norm())
        assert err < tol, f"sequence {i} ({dtype}): relative error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_graphs_equal_eager_prefill(dtype: torch.dtype) -> None:
    """Small incremental prefill steps replayed from the captured token buckets give the same
    logits as the eager paged path, for every bucket, with cached prefixes and shuffled blocks."""
    model = _model(dtype)
    eng = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=512, use_graphs=True))
    eng.runner.capture()
    graphs = eng.runner.prefill_graphs
    assert graphs is not None and set(graphs.graphs) == set(graphs.buckets)
    g = torch.Generator().manual_seed(3)
    for step, lengths in enumerate([[1], [5, 9], [16, 1, 7, 3], [40, 20, 3], [30, 30, 30, 30, 5], [2] * 16,
                                    [100, 60, 40]]):  # the last one needs the 256-token bucket
        prefix = [int(x) for x in torch.randint(0, 300, (len(lengths),), generator=g)]
        chunks = []
        for n, k in zip(lengths, prefix, strict=True):
            s = Sequence(keys=torch.randint(3, model.cfg.vocab_size, (k + n,), generator=g).tolist())
            s.block_table = [eng.blocks.allocate() for _ in range(-(-(k + n) // 16))][::-1]
            if k:
                eng.runner.prefill([PrefillChunk(s, 0, k, False)])
            chunks.append(PrefillChunk(s, k, n, True))
        before = graphs.replays
        got = eng.runner.prefill(chunks)
        assert graphs.replays == before + 1, f"step {step} did not replay a graph"
        assert got is not None
        got = got.clone()
        eng.runner.prefill_graphs = None
        try:
            ref = eng.runner.prefill(chunks)
        finally:
            eng.runner.prefill_graphs = graphs
        assert ref is not None
        err = float((got - ref).norm() / ref.norm())
        assert err < (1e-4 if dtype == torch.float32 else 1e-2), f"step {step} ({dtype}): relative error {err:.3g}"
        for c in chunks:
            eng.blocks.release(c.seq.block_table)
