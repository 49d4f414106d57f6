"""Overlapped decode through the captured CUDA graphs (bf16, SmolLM2-shaped, 4 layers): the same
tokens as the synchronous engine at batch 1 and in a padded bucket, with the next step's ids
written on the device and every overlapped step replaying a graph."""

from __future__ import annotations

import pytest
import torch

from tests.engine._tiny import random_llama_cuda
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.models.llama import LlamaModel
from tristream.engine.sequence import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return random_llama_cuda(torch.bfloat16)


def _tokens(model: LlamaModel, overlap: bool, n: int) -> tuple[list[list[int]], LLMEngine, int]:
    eng = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=512, max_model_len=1024,
                                              graph_buckets=(1, 2, 4, 8), decode_kernels="cublas", overlap=overlap))
    eng.runner.capture()
    dec = eng.runner.decoder
    assert dec is not None and dec.graphs
    replays = 0
    for g in dec.graphs.values():  # count replays: the overlapped steps must run the graphs
        orig = g.replay

        def counted(orig=orig) -> None:  # type: ignore[no-untyped-def]
            nonlocal replays
            replays += 1
            orig()
        g.replay = counted  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(n)
    ids = [eng.add_request(torch.randint(3, model.cfg.vocab_size, (int(40 + 9 * i),), generator=gen).tolist(),
                           SamplingParams(max_tokens=20 + 3 * i, ignore_eos=True)) for i in range(n)]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while eng.has_work():
        for o in eng.step():
            if o.token_id is not None:
                out[o.seq_id].append(o.token_id)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    return [out[i] for i in ids], eng, replays


@pytest.mark.parametrize("n", [1, 3, 8])
def test_overlap_through_graphs_equals_sync(model: LlamaModel, n: int) -> None:
    ref, _, _ = _tokens(model, False, n)
    got, eng, replays = _tokens(model, True, n)
    assert got == ref and [len(t) for t in got] == [20 + 3 * i for i in range(n)]
    assert eng.stats.overlap_steps >= 15 and replays >= eng.stats.overlap_steps
