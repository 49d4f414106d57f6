"""Batched (packed, varlen) prefill equals one prefill per sequence; grouping keeps padding bounded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine._tiny import tiny_hf_model
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.loader import load_model
from tristream.engine.models.llama import LlamaModel
from tristream.engine.packed_attention import KEY_ALIGN, group_chunks
from tristream.engine.runner import PrefillChunk
from tristream.engine.sequence import SamplingParams, Sequence


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    d: Path = tmp_path_factory.mktemp("tiny_packed")
    tiny_hf_model("llama3", d, seed=11)
    return load_model(d)


def _engine(model: LlamaModel, packed: bool) -> LLMEngine:
    return LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=256, max_prefill_tokens=64,
                                               packed_prefill=packed))


def _seqs(eng: LLMEngine, prompts: list[list[int]]) -> list[Sequence]:
    out = []
    for p in prompts:
        s = Sequence(keys=list(p))
        s.block_table = [eng.blocks.allocate() for _ in range(-(-len(p) // 4))][::-1]  # scattered blocks
        out.append(s)
    return out


def test_batched_prefill_of_n_sequences_equals_n_single_prefills(model: LlamaModel) -> None:
    g = torch.Generator().manual_seed(3)
    lengths = [13, 1, 40, 7, 25, 2, 33]
    prefix = [0, 0, 17, 3, 24, 1, 8]  # tokens already in the cache before the batched step
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]
    packed, single = _engine(model, True), _engine(model, False)
    pa, si = _seqs(packed, prompts), _seqs(single, prompts)
    for s_p, s_s, k in zip(pa, si, prefix, strict=True):  # the cached prefix, one sequence at a time
        if k:
            packed.runner.prefill([PrefillChunk(s_p, 0, k, False)])
            single.runner.prefill([PrefillChunk(s_s, 0, k, False)])
    got = packed.runner.prefill([PrefillChunk(s, k, n - k, True) for s, k, n in zip(pa, prefix, lengths, strict=True)])
    assert got is not None and got.shape[0] == len(prompts)
    for i, (s, k, n) in enumerate(zip(si, prefix, lengths, strict=True)):
        ref = single.runner.prefill([PrefillChunk(s, k, n - k, True)])
        assert ref is not None
        err = float((got[i] - ref[0]).abs().max() / ref[0].abs().max())
        assert err < 1e-5, f"sequence {i}: relative error {err}"
    for layer in range(model.cfg.num_layers):  # the same K/V landed in every sequence's slots
        for s_p, s_s, n in zip(pa, si, lengths, strict=True):
            from tristream.engine.runner import slots_np

            kp = packed.cache.flat(layer)[0][torch.from_numpy(slots_np(s_p.block_table, n, 4))]
            ks = single.cache.flat(layer)[0][torch.from_numpy(slots_np(s_s.block_table, n, 4))]
            # relative to the layer's largest key, as the logits above: the two attention paths sum
            # in another order, and an element-wise atol of 1e-6 sat at float32 noise (max |dK|
            # 2.4-2.9e-6 on every instruction set, with torch's or the native norms)
            err = float((kp - ks).abs().max() / ks.abs().max())
            assert err < 1e-5, f"layer {layer}: keys differ by {err:.2e} of their largest"


def test_engine_outputs_identical_with_packed_prefill(model: LlamaModel) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (13, 3, 40, 7, 25, 1, 60)]
    results = []
    for packed in (False, True):
        eng = _engine(model, packed)
        eng.config.max_prefill_tokens = 40  # chunked: later chunks have cached prefixes
        results.append(eng.generate(prompts, params))
    assert results[0] == results[1]
    assert all(len(r) == 8 for r in results[1])


@given(st.lists(st.tuples(st.integers(1, 600), st.integers(0, 2000)), min_size=1, max_size=64),
       st.sampled_from([0, 1 << 12, 1 << 19]))
@settings(max_examples=100, deadline=None)
def test_grouping_covers_every_chunk_once_with_bounded_padding(shape: list[tuple[int, int]], slack: int) -> None:
    q_lens = [q for q, _ in shape]
    ctx_lens = [q + c for q, c in shape]

    def work(idx: list[int]) -> int:
        lk = -(-max(ctx_lens[i] for i in idx) // KEY_ALIGN) * KEY_ALIGN
        return len(idx) * max(q_lens[i] for i in idx) * lk

    groups = group_chunks(q_lens, ctx_lens, slack)
    assert sorted(i for grp in groups for i in grp) == list(range(len(q_lens)))
    for grp in groups:  # padding never costs more than the launches it saves
        assert work(grp) <= sum(work([i]) for i in grp) + slack * (len(grp) - 1)
    if slack == 0:  # no slack: only chunks of one shape share a group
        assert all(len({q_lens[i] for i in grp}) == 1 for grp in groups)


def test_packed_attention_accepts_a_permuted_sdpa_output(model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA SDPA kernels may return [B, H, L, D] stored as [B, L, H, D]: the result must not change."""
    import tristream.engine.packed_attention as pa

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 4, 21)]
    runs = []
    for permuted in (False, True):
        if permuted:
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def strided(*a, _sdpa=sdpa, **kw):  # type: ignore[no-untyped-def]
                o = _sdpa(*a, **kw)
                return o.transpose(1, 2).contiguous().transpose(1, 2)

            monkeypatch.setattr(pa.F, "scaled_dot_product_attention", strided)
        eng = _engine(model, True)
        ss = _seqs(eng, prompts)
        for s in ss:
            eng.runner.prefill([PrefillChunk(s, 0, 2, False)])
        lg = eng.runner.prefill([PrefillChunk(s, 2, len(s.keys) - 2, True) for s in ss])
        assert lg is not None
        runs.append(lg)
    assert torch.equal(runs[0], runs[1])
