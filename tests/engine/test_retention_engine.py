"""KV retention in the engine: exact logits after eviction, policy order, budgets, refcounts, preemption.

The reference for exactness is a plain dense torch forward over the whole logical context in
which each query row masks out exactly the positions that were evicted when the engine computed
that row (logical RoPE positions unchanged). The engine's runner is wrapped (a spy: the real
runner runs) to record, for every computed row, the evicted set in effect and the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine._tiny import tiny_hf_model
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.kv_retention import KVBudgetError, RetentionConfig
from tristream.engine.loader import load_model
from tristream.engine.models.llama import LlamaModel
from tristream.engine.retention_probe import attention_probe
from tristream.engine.rope import apply_rope
from tristream.engine.sequence import FinishReason, SamplingParams, Sequence

BS = 4
RET = RetentionConfig(sink_tokens=4, text_window_tokens=8)  # min budget (1 + 2 + 2) blocks = 20 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    d: Path = tmp_path_factory.mktemp("tiny_ret")
    tiny_hf_model("llama3", d, seed=11)
    return load_model(d)


def make_engine(model: LlamaModel, **kw: Any) -> LLMEngine:
    cfg: dict[str, Any] = dict(block_size=BS, num_blocks=96, max_prefill_tokens=512, retention=RET,
                               max_model_len=512)
    cfg.update(kw)
    return LLMEngine(model, None, EngineConfig(**cfg))


def evicted_positions(seq: Sequence, bs: int = BS) -> frozenset[int]:
    return frozenset(b * bs + i for b in seq.evicted_blocks for i in range(bs))


class MaskedDense:
    """Dense attention over a whole context with a per-query bool mask [T, T]; records the
    head-averaged probabilities of the rows asked for."""

    def __init__(self, model: LlamaModel, mask: torch.Tensor, record_row: int | None = None) -> None:
        cfg = model.cfg
        self.cfg, self.mask = cfg, mask
        t = mask.shape[0]
        cs = model.cos_sin[:t].to(model.dtype)
        self.cos, self.sin = cs[:, None, :cfg.head_dim // 2], cs[:, None, cfg.head_dim // 2:]
        self.record_row = record_row
        self.probs: list[torch.Tensor] = []

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        t, hd = qkv.shape[0], cfg.head_dim
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = apply_rope(q.view(t, cfg.num_heads, hd), self.cos, self.sin).transpose(0, 1)
        k = apply_rope(k.view(t, cfg.num_kv_heads, hd), self.cos, self.sin).transpose(0, 1)
        v = v.reshape(t, cfg.num_kv_heads, hd).transpose(0, 1)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = (q.float() @ k.float().transpose(1, 2)) * hd ** -0.5  # fp32 math for a bf16 model too
        probs = scores.masked_fill(~self.mask[None], float("-inf")).softmax(-1)
        if self.record_row is not None:
            self.probs.append(probs[:, self.record_row].mean(0))
        return (probs @ v.float()).to(qkv.dtype).transpose(0, 1).reshape(t, cfg.q_size)


def reference(model: LlamaModel, seq: Sequence, upto: int, evicted_at: dict[int, frozenset[int]],
              record_row: int | None = None, embeds: list[tuple[int, torch.Tensor]] | None = None
              ) -> tuple[torch.Tensor, MaskedDense]:
    """Logits [upto, vocab] of a dense forward over logical positions [0, upto) where query t
    does not see the positions in evicted_at[t]. `embeds`: the sequence's embedding segments
    (default `seq.embeds`; the engine frees those of evicted positions, the Recorder keeps them)."""
    mask = torch.tril(torch.ones(upto, upto, dtype=torch.bool))
    for t in range(upto):
        for j in evicted_at.get(t, ()):
            if j < upto:
                mask[t, j] = False
    ids = torch.tensor([max(k, 0) for k in seq.keys[:upto]], device=model.device)
    with torch.inference_mode():
        h = model.embed(ids)
        for start, emb in (seq.embeds if embeds is None else embeds):
            lo, hi = start, min(start + emb.shape[0], upto)
            if lo < hi:
                h[lo:hi] = emb[:hi - lo].to(device=h.device, dtype=h.dtype)
        attn = MaskedDense(model, mask.to(model.device), record_row)
        return model.logits(model(h, attn)), attn


class Recorder:
    """Spy on the runner: per computed row, the sequence, logical position, evicted set and logits."""

    def __init__(self, eng: LLMEngine) -> None:
        self.rows: list[tuple[Sequence, int, frozenset[int], torch.Tensor | None]] = []
        self.embeds: dict[int, dict[int, torch.Tensor]] = {}  # seq id -> start -> rows, as first seen
        prefill, decode = eng.runner.prefill, eng.runner.decode
        bs = eng.blocks.block_size

        def spy_prefill(chunks: list[Any]) -> torch.Tensor | None:
            for c in chunks:
                for start, emb in c.seq.embeds:
                    self.embeds.setdefault(c.seq.seq_id, {}).setdefault(start, emb)
            ev = [evicted_positions(c.seq, bs) for c in chunks]
            logical = [c.seq.positions(c.start, c.start + c.length, bs) for c in chunks]
            out = prefill(chunks)
            r = 0
            for c, e, lp in zip(chunks, ev, logical, strict=True):
                for p in (range(c.start, c.start + c.length) if lp is None else lp.tolist()):
                    lg = None
                    if c.want_logits and p == (c.start + c.length - 1 if lp is None else int(lp[-1])):
                        assert out is not None
                        lg = out[r].clone()
                        r += 1
                    self.rows.append((c.seq, p, e, lg))
            return out

        def spy_decode(seqs: list[Sequence]) -> torch.Tensor:
            ev = [evicted_positions(s, bs) for s in seqs]
            pos = [len(s.keys) - 1 for s in seqs]
            out = decode(seqs)
            for i, (s, e) in enumerate(zip(seqs, ev, strict=True)):
                self.rows.append((s, pos[i], e, out[i].clone()))
            return out

        eng.runner.prefill = spy_prefill  # type: ignore[method-assign]
        eng.runner.decode = spy_decode  # type: ignore[method-assign]
        # every decode step through `decode`, for its logits (not the graphs' greedy host path; its
        # tokens are compared with this path's after eviction in tests/engine/test_overlap_interpret.py)
        eng.runner.decode_greedy_host = lambda seqs: None  # type: ignore[method-assign]

    def seq_embeds(self, seq: Sequence) -> list[tuple[int, torch.Tensor]]:
        return sorted(self.embeds.get(seq.seq_id, {}).items(), key=lambda kv: kv[0])

    def check(self, model: LlamaModel, seq: Sequence, tol: float = 1e-4, norm: bool = False) -> int:
        """Compare every recorded logits row of `seq` with the masked dense reference: relative
        max-abs error (or, with `norm`, relative L2 error in float32) below `tol`."""
        evicted_at: dict[int, frozenset[int]] = {}
        checked = 0
        for s, p, e, lg in self.rows:
            if s is not seq:
                continue
            evicted_at[p] = e
            if lg is None:
                continue
            ref, _ = reference(model, seq, p + 1, evicted_at, embeds=self.seq_embeds(seq))
            if norm:
                err = float((lg.float() - ref[p].float()).norm() / ref[p].float().norm())
            else:
                err = float((lg - ref[p]).abs().max() / ref[p].abs().max())
            assert err < tol, f"position {p}: logits differ from the masked reference (rel err {err:.3g})"
            checked += 1
        return checked


def vision_context(eng: LLMEngine, model: LlamaModel, seed: int = 0, **kw: Any) -> int:
    """Open a context: text, vision (3 full blocks), text, vision (unaligned), text."""
    g = torch.Generator().manual_seed(seed)
    hid = model.cfg.hidden_size
    sid = eng.add_request([1, 5, 9, 13, 17, 21, 25, 29], generate=False, **kw)
    eng.append(sid, embeddings=torch.randn(12, hid, generator=g) * 0.5)  # positions 8..19: vision blocks
    eng.append(sid, token_ids=[40, 41, 42, 43, 44, 45])
    eng.append(sid, embeddings=torch.randn(10, hid, generator=g) * 0.5)  # 26..35: 2 vision blocks + 2 mixed
    eng.append(sid, token_ids=[60, 61, 62, 63, 64, 65, 66])
    return sid


def run_all(eng: LLMEngine, budget_blocks: int | None = None, seq: Sequence | None = None,
            max_steps: int = 2000) -> list[Any]:
    outs = []
    for _ in range(max_steps):
        if not eng.has_work():
            break
        outs += eng.step()
        if budget_blocks is not None and seq is not None and seq.block_table:
            assert len(seq.block_table) <= budget_blocks
    return outs


@pytest.mark.parametrize("packed", [False, True], ids=["torch", "packed"])
def test_logits_after_eviction_equal_masked_reference(model: LlamaModel, packed: bool) -> None:
    eng = make_engine(model, max_prefill_tokens=5, packed_prefill=packed)
    rec = Recorder(eng)
    sid = vision_context(eng, model, kv_budget_tokens=24)
    eng.step()
    seq = eng.seqs[sid]
    run_all(eng, 6, seq)
    eng.start_generation(sid, SamplingParams(max_tokens=14, ignore_eos=True))
    run_all(eng, 6, seq)
    st = eng.stats.retention
    assert st.evicted_blocks.get("vision_low_attention", 0) >= 3
    assert st.evicted_blocks.get("text_outside_window", 0) >= 1
    assert seq.cache_offset == BS * len(seq.evicted_blocks) > 0
    assert rec.check(model, seq) == 14  # the recomputed last prompt position, then 13 decode rows
    assert eng.stats.preemptions == 0 and st.over_budget == 0
    assert eng.blocks.num_free == eng.blocks.num_blocks
    eng.blocks.check()


def test_no_budget_is_unchanged(model: LlamaModel) -> None:
    ids = list(range(3, 50))
    a = make_engine(model).generate([ids], SamplingParams(max_tokens=10, ignore_eos=True))
    b = make_engine(model, kv_budget_tokens=4096).generate([ids], SamplingParams(max_tokens=10, ignore_eos=True))
    assert a == b
    eng = make_engine(model)
    eng.generate([ids], SamplingParams(max_tokens=10, ignore_eos=True))
    assert eng.stats.retention.evictions == 0


def test_probe_equals_reference_attention(model: LlamaModel) -> None:
    eng = make_engine(model)
    sid = vision_context(eng, model)
    run_all(eng)
    seq = eng.seqs[sid]
    n = seq.num_computed
    k_before = eng.cache.k.clone()
    got = attention_probe(model, eng.cache, seq)
    _, attn = reference(model, seq, n, {}, record_row=n - 1)
    want = torch.stack(attn.probs).mean(0).numpy()
    assert got.shape == (n,)
    np.testing.assert_allclose(got, want, atol=1e-5)
    last = attention_probe(model, eng.cache, seq, layers=1)
    np.testing.assert_allclose(last, attn.probs[-1].numpy(), atol=1e-5)
    assert torch.equal(eng.cache.k, k_before)  # read-only


def test_vision_blocks_leave_lowest_attention_first(model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    import tristream.engine.kv_retention as kr

    probes: list[tuple[list[int], list[int], np.ndarray]] = []

    def spy(m: LlamaModel, cache: Any, seq: Sequence, layers: int | None = None) -> np.ndarray:
        p = attention_probe(m, cache, seq, layers)
        probes.append((list(seq.block_table), seq.logical_blocks(), p))
        return p

    monkeypatch.setattr(kr, "attention_probe", spy)
    eng = make_engine(model, max_prefill_tokens=512)
    g = torch.Generator().manual_seed(3)
    sid = eng.add_request([1, 5, 9, 13], generate=False, kv_budget_tokens=40)  # 10 blocks
    eng.append(sid, embeddings=torch.randn(24, model.cfg.hidden_size, generator=g) * 0.5)  # 6 vision blocks
    eng.append(sid, token_ids=list(range(70, 82)))  # 3 text blocks: 10 blocks in all
    run_all(eng)
    seq = eng.seqs[sid]
    assert not seq.evicted_blocks
    eng.append(sid, token_ids=list(range(90, 99)))  # 9 more tokens: 3 blocks over budget
    run_all(eng)
    assert len(probes) == 1
    table, logical, p = probes[0]
    mass = {lb: float(p[j * BS:(j + 1) * BS].sum()) for j, lb in enumerate(logical)}
    vision = [lb for lb in range(1, 7)]
    expect = sorted(vision, key=lambda lb: mass[lb])[:3]
    assert sorted(seq.evicted_blocks) == sorted(expect)
    assert eng.stats.retention.evicted_blocks == {"vision_low_attention": 3}
    # the evicted positions' embeddings are freed; the kept ones survive as their own segments
    assert eng.stats.retention.dropped_embedding_rows == 3 * BS
    kept_rows = {st + i for st, e in seq.embeds for i in range(e.shape[0])}
    assert kept_rows == {p for p in range(4, 28) if p // BS not in seq.evicted_blocks}
    assert mass[expect[-1]] <= min(mass[lb] for lb in vision if lb not in expect)


def test_sinks_and_text_window_kept_during_long_generation(model: LlamaModel) -> None:
    eng = make_engine(model)
    budget = 28  # 7 blocks
    sid = eng.add_request(list(range(3, 30)), SamplingParams(max_tokens=300, ignore_eos=True),
                          kv_budget_tokens=budget)
    seq: Sequence | None = None
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        seq = eng.seqs.get(sid, seq)
        if seq is None or sid not in eng.seqs:
            continue
        assert len(seq.block_table) <= budget // BS
        ev = evicted_positions(seq)
        assert not ev & set(range(RET.sink_tokens))
        assert not ev & set(range(max(0, seq.num_computed - RET.text_window_tokens), seq.num_computed))
    assert seq is not None and seq.finish_reason is FinishReason.LENGTH and len(seq.output_ids) == 300
    assert eng.stats.preemptions == 0 and eng.stats.retention.over_budget == 0
    assert eng.stats.retention.evicted_blocks["text_outside_window"] >= (327 - budget) // BS - 1
    assert eng.stats.retention.probes == 0  # text only: no attention probe needed
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_long_generation_matches_reference_and_frees(model: LlamaModel) -> None:
    eng = make_engine(model)
    rec = Recorder(eng)
    sid = eng.add_request(list(range(3, 15)), SamplingParams(max_tokens=60, ignore_eos=True), kv_budget_tokens=20)
    eng.step()
    seq = eng.seqs[sid]
    run_all(eng, 5, seq)
    assert rec.check(model, seq) == 60
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_cancel_and_finish_free_everything(model: LlamaModel) -> None:
    eng = make_engine(model)
    a = vision_context(eng, model, kv_budget_tokens=24)
    b = eng.add_request(list(range(3, 40)), SamplingParams(max_tokens=30, ignore_eos=True), kv_budget_tokens=20)
    for _ in range(6):
        eng.step()
    assert eng.stats.retention.evictions > 0
    eng.cancel(a)
    run_all(eng)
    assert b not in eng.seqs and a not in eng.seqs
    assert eng.blocks.num_free == eng.blocks.num_blocks
    eng.blocks.check()


def test_shared_prefix_survives_eviction_by_another_sequence(model: LlamaModel) -> None:
    prompt = list(range(100, 140))  # 10 full blocks
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = make_engine(model).generate([prompt], params)[0]
    eng = make_engine(model)
    first = eng.generate([prompt], params)[0]  # publishes the prompt's blocks
    assert first == alone
    rec = Recorder(eng)
    a = eng.add_request(prompt + [7, 8, 9], SamplingParams(max_tokens=20, ignore_eos=True), kv_budget_tokens=20)
    b = eng.add_request(prompt, params)
    outs = eng.step()
    seq_a = eng.seqs[a]
    outs += run_all(eng)
    assert [o.token_id for o in outs if o.seq_id == b] == alone
    assert eng.stats.prefix_cached_tokens >= 2 * 36
    assert seq_a.evicted_blocks and rec.check(model, seq_a) >= 20
    again = eng.generate([prompt], params)[0]  # the prefix cache still holds a plain prefix
    assert again == alone
    assert eng.blocks.num_free == eng.blocks.num_blocks
    eng.blocks.check()


def test_evicted_sequence_publishes_nothing_new(model: LlamaModel) -> None:
    eng = make_engine(model)
    sid = eng.add_request(list(range(3, 30)), SamplingParams(max_tokens=40, ignore_eos=True), kv_budget_tokens=20)
    eng.step()
    seq = eng.seqs[sid]
    evicting_steps = 0
    while sid in eng.seqs:
        before = dict(eng.blocks.by_hash)
        eng.step()
        if seq.evicted_blocks:
            evicting_steps += 1
            assert {h: b for h, b in eng.blocks.by_hash.items() if before.get(h) != b} == {}
    assert evicting_steps > 10


def test_preemption_after_eviction_recomputes_and_matches(model: LlamaModel) -> None:
    """Preemption keeps the evictions: only the kept positions are recomputed, at their logical
    positions (sinks before the evicted gap, the window after it), and the continuation is exact
    against the masked reference of the recomputed state."""
    eng = make_engine(model, num_blocks=12, max_prefill_tokens=8)
    rec = Recorder(eng)
    low = eng.add_request(list(range(3, 43)), generate=False, kv_budget_tokens=24)  # 10 blocks > 6
    eng.step()
    seq = eng.seqs[low]
    run_all(eng, 6, seq)
    assert seq.evicted_blocks and len(seq.block_table) == 6
    evicted, gone = list(seq.evicted_blocks), evicted_positions(seq)
    mark = len(rec.rows)
    hi = eng.add_request(list(range(200, 230)), SamplingParams(max_tokens=4, ignore_eos=True), priority=5)
    run_all(eng)  # hi needs 8 of the 12 blocks: low (idle) is preempted, then recomputed
    assert hi not in eng.seqs and seq.num_preemptions >= 1 and eng.stats.preemptions == seq.num_preemptions
    assert seq.num_pending == 0 and len(seq.block_table) == 6 and seq.evicted_blocks == evicted
    redone = [p for s, p, _, _ in rec.rows[mark:] if s is seq]
    assert redone and not set(redone) & gone  # only kept positions were recomputed
    assert set(range(RET.sink_tokens)) <= set(redone) | set(range(seq.num_cached_tokens))  # sinks: recomputed or cached
    eng.start_generation(low, SamplingParams(max_tokens=20, ignore_eos=True))
    run_all(eng, 6, seq)
    assert seq.finish_reason is FinishReason.LENGTH and len(seq.output_ids) == 20
    assert len(seq.evicted_blocks) > len(evicted)  # decoding evicts further
    assert rec.check(model, seq) == 20
    assert eng.blocks.num_free == eng.blocks.num_blocks
    eng.blocks.check()


def test_bad_budgets_are_refused(model: LlamaModel) -> None:
    with pytest.raises(KVBudgetError, match="must be ≥ 20"):
        make_engine(model, kv_budget_tokens=16)
    eng = make_engine(model)
    with pytest.raises(KVBudgetError, match="too small"):
        eng.add_request([1, 2, 3], kv_budget_tokens=8)
    with pytest.raises(KVBudgetError, match="≥ 0"):
        make_engine(model, kv_budget_tokens=64, retention=RetentionConfig(sink_tokens=-1))


def test_dense_reference_without_eviction_is_plain_causal(model: LlamaModel) -> None:
    seq = Sequence(keys=list(range(3, 20)))
    got, _ = reference(model, seq, 17, {})
    with torch.inference_mode():
        h = model.embed(torch.tensor(seq.keys))
        cfg = model.cfg

        def causal(layer: int, qkv: torch.Tensor) -> torch.Tensor:
            t = qkv.shape[0]
            cs = model.cos_sin[:t]
            cos, sin = cs[:, None, :cfg.head_dim // 2], cs[:, None, cfg.head_dim // 2:]
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = apply_rope(q.view(t, cfg.num_heads, cfg.head_dim), cos, sin).transpose(0, 1)[None]
            k = apply_rope(k.view(t, cfg.num_kv_heads, cfg.head_dim), cos, sin).transpose(0, 1)[None]
            v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return o[0].transpose(0, 1).reshape(t, cfg.q_size)

        want = model.logits(model(h, causal))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_recompute_after_eviction_copies_a_shared_last_block(model: LlamaModel) -> None:
    """start_generation on a fully computed context recomputes its last position; after eviction
    that rewrites K/V, so a last block shared through the prefix cache is copied first."""
    prompt = list(range(100, 140))  # 10 full blocks, published
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = make_engine(model).generate([prompt + [7]], params)[0]
    eng = make_engine(model)
    a = eng.add_request(prompt, generate=False, kv_budget_tokens=40)
    run_all(eng)
    seq_a = eng.seqs[a]
    b = eng.add_request(prompt + [7], params)
    eng.step()  # b admitted: it shares a's 10 blocks
    seq_b = eng.seqs[b]
    shared = seq_b.block_table[9]
    assert shared == seq_a.block_table[9] and eng.blocks.blocks[shared].ref_count == 2
    eng.retention._evict(seq_a, 8)  # what a budget fit does: 2 text blocks leave a's table
    assert seq_a.cache_offset == 2 * BS and seq_a.block_table[-1] == shared
    k_before = eng.cache.k[:, shared].clone()
    eng.start_generation(a, params)
    outs = run_all(eng)
    assert eng.stats.retention.copied_blocks == 1
    assert torch.equal(eng.cache.k[:, shared], k_before)  # b's block untouched
    got_b = [o.token_id for o in outs if o.seq_id == b]
    assert got_b == alone[1:]  # the first token came in the admitting step
    assert eng.blocks.num_free == eng.blocks.num_blocks
    eng.blocks.check()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget_blocks=st.integers(5, 9), window=st.sampled_from([4, 8]),
       ops=st.lists(st.tuples(st.sampled_from(["text", "vision", "generate"]), st.integers(1, 14)),
                    min_size=2, max_size=7))
def test_budget_invariants_under_random_turns(model: LlamaModel, budget_blocks: int, window: int,
                                              ops: list[tuple[str, int]]) -> None:
    """Random turns (text, vision embeddings, generation) under a random valid budget: the block
    count never exceeds it, sinks and the recent text window stay, nothing runs over budget or
    preempts, and closing the context frees every block."""
    ret = RetentionConfig(sink_tokens=4, text_window_tokens=window)
    eng = make_engine(model, retention=ret, max_prefill_tokens=7)
    g = torch.Generator().manual_seed(budget_blocks)
    sid = eng.add_request([1, 2, 3], generate=False, kv_budget_tokens=budget_blocks * BS)
    for kind, n in ops:
        if kind == "text":
            eng.append(sid, token_ids=[(7 * i + n) % 290 + 3 for i in range(n)])
        elif kind == "vision":
            eng.append(sid, embeddings=torch.randn(n, model.cfg.hidden_size, generator=g) * 0.5)
        else:
            eng.start_generation(sid, SamplingParams(max_tokens=n, ignore_eos=True))
        for _ in range(500):
            eng.step()
            if sid not in eng.seqs:  # generation finished (and freed) it
                break
            seq = eng.seqs[sid]
            assert len(seq.block_table) <= budget_blocks
            ev = evicted_positions(seq)
            assert not ev & set(range(ret.sink_tokens))
            recent_text = {p for p in range(max(0, seq.num_computed - window), seq.num_computed) if seq.keys[p] >= 0}
            assert not recent_text & ev  # text among the newest `window` positions is kept
            if not eng.has_work():
                break
        if kind == "generate":  # generation finishes the sequence: open a new one
            assert sid not in eng.seqs
            sid = eng.add_request([1, 2, 3], generate=False, kv_budget_tokens=budget_blocks * BS)
    eng.close(sid)
    eng.step()
    assert eng.stats.retention.over_budget == 0 and eng.stats.preemptions == 0
    assert eng.blocks.num_free == eng.blocks.num_blocks
    eng.blocks.check()


def test_budget_does_not_lift_max_model_len(model: LlamaModel) -> None:
    """A budget bounds the cache, not logical positions (the RoPE table): an append that would
    pass max_model_len finishes the context with LENGTH instead of failing the step."""
    eng = make_engine(model, max_model_len=64)
    sid = eng.add_request([1, 2, 3], generate=False, kv_budget_tokens=24)
    eng.append(sid, token_ids=list(range(3, 50)))
    run_all(eng)
    assert eng.seqs[sid].cache_offset > 0
    eng.append(sid, token_ids=list(range(3, 20)))  # 50 + 17 > 64
    outs = eng.step()
    assert [(o.seq_id, o.finished, o.finish_reason) for o in outs] == [(sid, True, FinishReason.LENGTH)]
    assert sid not in eng.seqs and eng.stats.context_full == 1
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_preemption_recomputes_kept_vision_between_evicted_blocks(model: LlamaModel) -> None:
    """Kept vision blocks between evicted ones are recomputed at their logical positions from
    their embeddings (gathered keys, positions and splices), exactly."""
    eng = make_engine(model, num_blocks=16)
    rec = Recorder(eng)
    g = torch.Generator().manual_seed(3)
    low = eng.add_request([1, 5, 9, 13], generate=False, kv_budget_tokens=40)  # 10 blocks
    eng.append(low, embeddings=torch.randn(24, model.cfg.hidden_size, generator=g) * 0.5)  # logical blocks 1-6
    eng.append(low, token_ids=list(range(70, 82)))
    run_all(eng)
    seq = eng.seqs[low]
    eng.append(low, token_ids=list(range(90, 99)))  # 3 vision blocks leave
    run_all(eng)
    assert len(seq.evicted_blocks) == 3 and all(1 <= b <= 6 for b in seq.evicted_blocks)
    gap_vision = [b for b in range(1, seq.evicted_blocks[-1]) if b not in seq.evicted_blocks]
    assert gap_vision  # kept vision blocks before the last evicted one: the gathered case
    mark = len(rec.rows)
    hi = eng.add_request(list(range(200, 230)), SamplingParams(max_tokens=3, ignore_eos=True), priority=5)
    run_all(eng)
    assert hi not in eng.seqs and seq.num_preemptions >= 1
    redone = {p for s, p, _, _ in rec.rows[mark:] if s is seq}
    assert {b * BS for b in gap_vision} <= redone and not redone & evicted_positions(seq)
    eng.start_generation(low, SamplingParams(max_tokens=6, ignore_eos=True))
    run_all(eng)
    assert rec.check(model, seq) >= 6
    assert eng.blocks.num_free == eng.blocks.num_blocks
    eng.blocks.check()
