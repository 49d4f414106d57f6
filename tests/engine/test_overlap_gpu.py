"""Overlapped decode through the captured CUDA graphs (bf16, SmolLM2-shaped, 4 layers): the same
tokens as the synchronous engine at batch 1, in a padded bucket and at 8, with the next step's
ids written on the device and every overlapped step replaying a graph. One engine (graphs
captured once), overlap switched between the two runs."""

from __future__ import annotations

import pytest
import torch

from tests.engine._tiny import random_llama_cuda
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.sequence import SamplingParams

pytestmark = pytest.mark.gpu


class _Counted:
    """A captured graph whose replays are counted (the serve tests' helper needs the serve deps)."""

    def __init__(self, g: torch.cuda.CUDAGraph, counter: dict[str, int]) -> None:
        self.g, self.counter = g, counter

    def replay(self) -> None:
        self.counter["n"] += 1
        self.g.replay()


def count_replays(graphs: dict[int, torch.cuda.CUDAGraph]) -> dict[str, int]:
    counter = {"n": 0}
    for b in list(graphs):
        graphs[b] = _Counted(graphs[b], counter)  # type: ignore[assignment]
    return counter


@pytest.fixture(scope="module")
def engine() -> tuple[LLMEngine, dict[str, int]]:
    model = random_llama_cuda(torch.bfloat16)
    eng = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=512, max_model_len=1024,
                                              graph_buckets=(1, 2, 4, 8), decode_kernels="cublas",
                                              enable_prefix_cache=False))
    eng.runner.capture()
    dec = eng.runner.decoder
    assert dec is not None and dec.graphs
    return eng, count_replays(dec.graphs)


def _tokens(eng: LLMEngine, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n)
    ids = [eng.add_request(torch.randint(3, eng.model.cfg.vocab_size, (int(40 + 9 * i),), generator=gen).tolist(),
                           SamplingParams(max_tokens=20 + 3 * i, ignore_eos=True)) for i in range(n)]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while eng.has_work():
        for o in eng.step():
            if o.token_id is not None:
                out[o.seq_id].append(o.token_id)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    return [out[i] for i in ids]


@pytest.mark.parametrize("n", [1, 3, 8])
def test_overlap_through_graphs_equals_sync(engine: tuple[LLMEngine, dict[str, int]], n: int) -> None:
    eng, replays = engine
    eng.set_overlap(False)
    ref = _tokens(eng, n)
    eng.set_overlap(True)
    steps0, ahead0, replays0 = eng.stats.steps, eng.stats.overlap_steps, replays["n"]
    got = _tokens(eng, n)
    eng.set_overlap(False)
    assert got == ref and [len(t) for t in got] == [20 + 3 * i for i in range(n)]
    ahead = eng.stats.overlap_steps - ahead0
    assert ahead >= 15 and replays["n"] - replays0 >= ahead  # decode steps ran ahead, through the graphs
    assert eng.stats.steps - steps0 <= 20 + 3 * (n - 1) + 2  # one step per token (plus prefill chunks)


@pytest.mark.parametrize("n", [1, 2])
def test_steady_decode_copies_inputs_only_when_a_block_table_grows(engine: tuple[LLMEngine, dict[str, int]],
                                                                    n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that does not change advances its inputs inside the graph (kernels/advance.py) and
    reads its tokens from the graph's mapped host slot: a copy per new block (16 tokens), not per
    step, synchronous (`DecodeGraphs.run_greedy_host`) or overlapped, with the same tokens as the
    float32-logits path that copies every step."""
    eng, _ = engine
    dec = eng.runner.decoder
    assert dec is not None
    gen = torch.Generator().manual_seed(100 + n)
    prompts = [torch.randint(3, eng.model.cfg.vocab_size, (37,), generator=gen).tolist() for _ in range(n)]

    def run() -> tuple[list[list[int]], int]:
        ids = [eng.add_request(p, SamplingParams(max_tokens=90, ignore_eos=True)) for p in prompts]
        out: dict[int, list[int]] = {i: [] for i in ids}
        up0 = dec.uploads
        while eng.has_work():
            for o in eng.step():
                if o.token_id is not None:
                    out[o.seq_id].append(o.token_id)
        assert eng.blocks.num_free == eng.blocks.num_blocks
        return [out[i] for i in ids], dec.uploads - up0

    eng.set_overlap(False)
    with monkeypatch.context() as m:  # the reference: logits, argmax, copy back, inputs copied every step
        m.setattr(eng.runner, "decode_greedy_host", lambda seqs: None)
        ref, ref_uploads = run()
    sync, sync_uploads = run()
    eng.set_overlap(True)
    got, uploads = run()
    eng.set_overlap(False)
    assert sync == ref and got == ref
    assert ref_uploads >= 89
    # 37 + 90 positions cross 6 block boundaries (bs 16); plus the first step and the last (one row left)
    assert sync_uploads <= 10 and uploads <= 10, (sync_uploads, uploads)
