"""The batch-1 decode step as one persistent CUDA kernel (`kernels/decode_mega_cuda.py`, variant "mega")."""

from __future__ import annotations

import pytest
import torch

from tristream.engine.config import preset
from tristream.engine.kernel_choice import variant_agrees
from tristream.engine.kernels.decode_mega_cuda import MAX_PREFETCH_WORDS, prefetch_words


def test_prefetch_budget_admits_small_models_only() -> None:
    """The registers a warp holds ahead of a stage: SmolLM2-135M fits, Llama-3.2-1B would spill."""
    small = prefetch_words(preset("smollm2-135m"), 132)
    big = prefetch_words(preset("llama-3.2-1b"), 132)
    assert small == 36 and small <= MAX_PREFETCH_WORDS < big


@pytest.mark.gpu
@pytest.mark.parametrize("qwen", [False, True])
def test_mega_kernel_agrees_with_cublas_and_replays(qwen: bool) -> None:
    """Logits of the one-kernel step against the cuBLAS path at every step of a growing context
    (prompts of 1-400 tokens: one to many key/value pages, positions past the 64 a block takes per
    pass), with and without QKV biases; its graph replays equal its eager run bit for bit, many times
    in a row (the launch epoch, and with it the tags waited for, advances), and an engine that decodes with it generates tokens."""
    from tests.engine._tiny import random_llama_cuda
    from tristream.engine.engine import EngineConfig, LLMEngine
    from tristream.engine.kernels.decode_mega_cuda import stalls, supported
    from tristream.engine.sequence import SamplingParams

    model = random_llama_cuda(torch.bfloat16, attention_bias=qwen)
    why = supported(model)
    if why is not None:
        pytest.skip(why)
    for length in (1, 63, 64, 65, 200, 400):
        eng = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=256, max_model_len=1024,
                                                  graph_buckets=(1, 2), decode_kernels="cublas", overlap=False))
        eng.runner.capture()
        g = torch.Generator().manual_seed(length)
        eng.add_request(torch.randint(3, model.cfg.vocab_size, (length,), generator=g).tolist(),
                        SamplingParams(max_tokens=40, ignore_eos=True))
        dec = eng.runner.decoder
        assert dec is not None
        for step in range(6):
            eng.step()
            seqs = list(eng.seqs.values())
            if not seqs or not seqs[0].is_decode:
                continue
            s = seqs[0]
            assert eng._ensure_blocks(s, len(s.keys), set())
            dec.prepare(seqs, 1)
            ref = dec.forward(1, "cublas").clone()
            dec.prepare(seqs, 1)
            got = dec.forward(1, "mega").clone()
            torch.cuda.synchronize()
            assert stalls(eng.runner.cache) is None
            err = float((got - ref).norm() / ref.norm())
            assert variant_agrees(got, ref, err), (length, step, err)
        # graph replay == eager, replay after replay
        dec.prepare(list(eng.seqs.values()), 1)
        eager = dec.forward(1, "mega").clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = dec.forward(1, "mega")
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        assert stalls(eng.runner.cache) is None
        assert torch.equal(out, eager), length
        del graph, eng

    eng = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=256, max_model_len=1024,
                                              graph_buckets=(1, 2), decode_kernels="mega"))
    eng.runner.capture()
    assert eng.runner.decoder is not None and eng.runner.decoder.variant_for(1) == "mega"
    toks = eng.generate([list(range(3, 40))], SamplingParams(max_tokens=24, ignore_eos=True))
    assert len(toks[0]) == 24
