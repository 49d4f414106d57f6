"""Speculative decoding: the n-gram drafter, the greedy and sampling verification rules, and the
engine's verify step (`EngineConfig.speculative`) against plain decoding on tiny random models
loaded through the real loader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.engine._tiny import tiny_hf_model
from tristream.engine.attention import AttnMetadata, TorchAttention
from tristream.engine.engine import EngineConfig, LLMEngine
from tristream.engine.loader import load_model
from tristream.engine.models.llama import LlamaModel
from tristream.engine.sequence import FinishReason, SamplingParams
from tristream.engine.speculative import (
    SpeculativeConfig,
    draft_len,
    propose_ngram,
    verify_greedy,
    verify_sampling,
)

PROMPTS = [[5, 17, 42, 99, 7, 250, 31, 8, 5, 17, 42], [100, 101, 102], list(range(20, 60))]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    d: Path = tmp_path_factory.mktemp("tiny_spec")
    tiny_hf_model("llama3", d, seed=7)
    return load_model(d)


def loopy_model(d: Path) -> LlamaModel:
    """The tiny model (written to `d`) with its layers' residual writes scaled down to 2%: the next
    token depends mostly on the current one (so greedy output falls into repeats that drafts
    predict) and still on the context through attention."""
    tiny_hf_model("llama3", d, seed=7)
    m = load_model(d)
    with torch.no_grad():
        for layer in m.layers:
            layer.o.weight.mul_(0.02)
            layer.down.weight.mul_(0.02)
    return m


@pytest.fixture(scope="module")
def loopy(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    return loopy_model(tmp_path_factory.mktemp("tiny_spec_loopy"))


def dense_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    meta = AttnMetadata.dense(len(ids))
    with torch.inference_mode():
        h = model(model.embed(torch.tensor(ids)), TorchAttention(model.cfg, model.cos_sin, meta, None, model.dtype))
        return model.logits(h)


def engine(model: LlamaModel, spec: SpeculativeConfig | None = None, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(block_size=4, num_blocks=96, max_prefill_tokens=512)
    cfg.update(kw)
    return LLMEngine(model, None, EngineConfig(speculative=spec, **cfg))  # type: ignore[arg-type]


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
        ) -> list[tuple[list[int], FinishReason | None]]:
    """Every output token (EOS included) and the finish reason of each prompt."""
    ps = params if isinstance(params, list) else [params] * len(prompts)
    ids = [eng.add_request(p, q) for p, q in zip(prompts, ps, strict=True)]
    toks: dict[int, list[int]] = {i: [] for i in ids}
    reason: dict[int, FinishReason | None] = {}
    for _ in range(2000):
        for o in eng.step():
            if o.token_id is not None:
                toks[o.seq_id].append(o.token_id)
            if o.finished:
                reason[o.seq_id] = o.finish_reason
        if len(reason) == len(ids):
            break
    return [(toks[i], reason[i]) for i in ids]


# ---- drafter


def test_drafter_finds_repeats() -> None:
    ctx = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert propose_ngram(ctx, max_ngram=3, max_draft=4) == [4, 5, 9, 9]
    assert propose_ngram(ctx, max_ngram=3, max_draft=2) == [4, 5]
    # the longest recurring suffix wins over a more recent shorter one
    assert propose_ngram([7, 8, 1, 2, 3, 6, 2, 3, 0, 1, 2, 3], max_ngram=3, max_draft=1) == [6]
    assert propose_ngram([7, 8, 1, 2, 3, 6, 2, 3, 0, 1, 2, 3], max_ngram=2, max_draft=1) == [0]
    assert propose_ngram([4, 2, 3, 5, 2, 3, 6, 1, 2, 3], max_ngram=3, max_draft=1) == [6]  # most recent
    # nothing recurs; too short; a lone token run predicts itself
    assert propose_ngram([1, 2, 3, 4, 5]) == []
    assert propose_ngram([3]) == []
    assert propose_ngram([8, 8, 8], max_ngram=2, max_draft=3) == [8]
    assert propose_ngram([1, 2, 3, 4, 1, 2], min_ngram=3) == []
    # embedding positions (negative keys) never match and end a draft
    assert propose_ngram([1, 2, -5, 3, 1, 2], max_draft=4) == []
    assert propose_ngram([1, 2, 7, -5, 1, 2], max_draft=4) == [7]


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        SpeculativeConfig(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError):
        SpeculativeConfig(max_draft=0)
    with pytest.raises(ValueError):
        SpeculativeConfig(row_cost=-1)


# ---- greedy rule


def test_verify_greedy_rule() -> None:
    assert verify_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert verify_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert verify_greedy([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert verify_greedy([], [3]) == [3]
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])


def test_greedy_verification_equals_plain_greedy(model: LlamaModel) -> None:
    """Drafts right for j tokens then wrong, scored in one forward of the real model: the rule
    emits the plain greedy tokens (the j right ones and the target's correction)."""
    for prompt in PROMPTS:
        ref = list(prompt)
        for _ in range(16):
            ref.append(int(dense_logits(model, ref)[-1].argmax()))
        gen = ref[len(prompt):]
        for at in (0, 3, 9):
            ctx = list(prompt) + gen[:at]
            for k in (1, 3, 5):
                for j in range(k + 1):
                    draft = gen[at:at + k]
                    if j < k:
                        draft = draft[:j] + [(draft[j] + 1) % model.cfg.vocab_size] + draft[j + 1:]
                    lg = dense_logits(model, ctx + draft)[len(ctx) - 1:]
                    got = verify_greedy(draft, lg.argmax(-1))
                    assert got == gen[at:at + j + 1], (prompt[:3], at, k, j)


# ---- sampling rule


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(counts.sum())
    exp = probs.double() * n
    keep = exp > 0
    return float(((counts.double()[keep] - exp[keep]) ** 2 / exp[keep]).sum())


def _bound(df: int) -> float:
    """A loose upper bound of chi-square with df degrees of freedom (mean + 6 standard deviations)."""
    return df + 6 * math.sqrt(2 * df)


def _tables(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(torch.randn(vocab, generator=g) * 1.5, 0)
    p2 = torch.softmax(torch.randn(vocab, vocab, generator=g) * 1.5, 1)  # p2[a]: target after token a
    q1 = torch.softmax(torch.randn(vocab, generator=g) * 1.5, 0)
    q2 = torch.softmax(torch.randn(vocab, vocab, generator=g) * 1.5, 1)
    return p1, p2, q1, q2


def _pairs(rule: str, n: int, vocab: int, seed: int) -> torch.Tensor:
    """Counts [vocab, vocab] of the first two tokens emitted when sampling from the target
    p(a) p2(b|a) with a 2-token draft; after an early rejection the second token is drawn
    from the target, as the next step would."""
    p1, p2, q1, q2 = _tables(vocab, seed)
    g = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(vocab, vocab, dtype=torch.int64)
    for i in range(n):
        if rule == "ngram":  # a deterministic drafter: a fixed guess per draw
            d = [i % vocab, (i * 7 + 3) % vocab]
            q = None
        else:
            a = int(torch.multinomial(q1, 1, generator=g))
            b = int(torch.multinomial(q2[a], 1, generator=g))
            d, q = [a, b], torch.stack([q1, q2[a]])
        p = torch.stack([p1, p2[d[0]], p2[d[1]]])  # p2 row for position 2 stands in for a 3rd-token law
        if rule == "always_accept":
            out = [d[0], d[1]]
        else:
            out = verify_sampling(d, p, q, generator=g)
        if len(out) == 1:
            out.append(int(torch.multinomial(p2[out[0]], 1, generator=g)))
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize("rule", ["ngram", "draft_model"])
def test_sampling_rule_preserves_the_target_distribution(rule: str) -> None:
    vocab, n = 5, 12000
    p1, p2, _, _ = _tables(vocab, 3)
    counts = _pairs(rule, n, vocab, 3)
    joint = p1[:, None] * p2
    assert _chi2(counts.sum(1), p1) < _bound(vocab - 1)
    assert _chi2(counts.flatten(), joint.flatten()) < _bound(vocab * vocab - 1)


def test_sampling_check_catches_a_biased_rule() -> None:
    """The same check on a rule that accepts every draft token fails (the test has power)."""
    vocab, n = 5, 12000
    p1, p2, _, _ = _tables(vocab, 3)
    counts = _pairs("always_accept", n, vocab, 3)
    assert _chi2(counts.flatten(), (p1[:, None] * p2).flatten()) > 10 * _bound(vocab * vocab - 1)


def test_sampling_rule_edge_cases() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert verify_sampling([1], p, generator=g) == [1, 2]  # p(x) = 1: always accepted
    assert verify_sampling([0], p, generator=g) == [1]  # p(x) = 0: always rejected, drawn without x
    q = torch.tensor([[0.0, 1.0, 0.0]])
    assert verify_sampling([1], p, q, generator=g) == [1, 2]  # p == q: accepted
    with pytest.raises(ValueError):
        verify_sampling([1, 2], p)


# ---- the engine's verify step


def test_engine_spec_equals_plain_greedy(loopy: LlamaModel, model: LlamaModel) -> None:
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    for m in (loopy, model):
        ref = run(engine(m), PROMPTS, params)
        for spec in (SpeculativeConfig(), SpeculativeConfig(max_ngram=2, max_draft=7)):
            eng = engine(m, spec)
            assert run(eng, PROMPTS, params) == ref
            assert eng.blocks.num_free == eng.blocks.num_blocks
            assert eng.stats.spec.verify_steps > 0
    eng = engine(loopy, SpeculativeConfig())
    run(eng, PROMPTS, params)
    st = eng.stats.spec
    assert 0 < st.accepted_tokens < st.draft_tokens  # whole and partial acceptance both happen
    assert st.emitted_tokens == st.verified_seqs + st.accepted_tokens
    assert eng.stats.steps < 48  # fewer target forwards than tokens


def test_engine_spec_packed_path_and_int4(loopy: LlamaModel, tmp_path: Path) -> None:
    """The packed forward (logits at every position of a chunk) and an int4 model (verify rows
    through the native all-layers decode step) give the plain engine's tokens."""
    from tristream.engine.quantize import quantize_model

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = run(engine(loopy, packed_prefill=True), PROMPTS, params)
    eng = engine(loopy, SpeculativeConfig(), packed_prefill=True)
    assert run(eng, PROMPTS, params) == ref
    assert eng.stats.spec.accepted_tokens > 0
    q = loopy_model(tmp_path)
    quantize_model(q, "int4")
    ref = run(engine(q), PROMPTS, params)
    eng = engine(q, SpeculativeConfig())
    assert run(eng, PROMPTS, params) == ref
    assert eng.stats.spec.accepted_tokens > 0


def test_engine_spec_one_sequence_per_forward_rows(loopy: LlamaModel) -> None:
    """Batch 1: fewer steps than tokens, and the same tokens."""
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    ref = run(engine(loopy), [PROMPTS[0]], params)
    eng = engine(loopy, SpeculativeConfig(max_draft=6))
    assert run(eng, [PROMPTS[0]], params) == ref
    assert eng.stats.steps < 60


def test_engine_spec_stops_where_plain_stops(loopy: LlamaModel) -> None:
    """max_tokens, stop tokens and EOS inside an accepted draft end the answer at the same token."""
    ref_free = run(engine(loopy), PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    for n in (1, 2, 3, 5, 8):
        p = SamplingParams(max_tokens=n, ignore_eos=True)
        assert run(engine(loopy, SpeculativeConfig()), PROMPTS, p) == run(engine(loopy), PROMPTS, p)
    for prompt, (toks, _) in zip(PROMPTS, ref_free, strict=True):
        p = SamplingParams(max_tokens=40, stop_token_ids=(toks[20],))  # a token drafts are likely to propose
        prompts = [prompt]
        assert run(engine(loopy, SpeculativeConfig()), prompts, p) == run(engine(loopy), prompts, p)
    eng = engine(loopy, SpeculativeConfig(), max_model_len=60)
    assert run(eng, [PROMPTS[2]], SamplingParams(max_tokens=40, ignore_eos=True)) == run(
        engine(loopy, max_model_len=60), [PROMPTS[2]], SamplingParams(max_tokens=40, ignore_eos=True))


def test_engine_spec_prefix_cache_and_continuation(loopy: LlamaModel) -> None:
    """Blocks published by verify steps hold the right K/V: a prompt that reuses them continues as
    plain decoding does."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    eng = engine(loopy, SpeculativeConfig())
    plain = engine(loopy, enable_prefix_cache=False)
    first = run(eng, [PROMPTS[2]], params)
    assert first == run(plain, [PROMPTS[2]], params)
    cont = PROMPTS[2] + first[0][0][:25]
    before = eng.stats.prefix_cached_tokens
    assert run(eng, [cont], params) == run(plain, [cont], params)
    assert eng.stats.prefix_cached_tokens - before >= 56  # the prompt's and the answer's full blocks


def test_engine_spec_beside_prefill_and_sampling(loopy: LlamaModel) -> None:
    """A verify step in a step that also prefills a newcomer, beside a sampling sequence (not
    eligible: it decodes as usual), gives what the plain engine gives."""
    def drive(eng: LLMEngine) -> dict[int, list[int]]:
        a = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
        b = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=5))
        names = {a: 0, b: 1}
        out: dict[int, list[int]] = {0: [], 1: [], 2: []}
        done = 0
        for i in range(500):
            if i == 4:
                names[eng.add_request(PROMPTS[2], SamplingParams(max_tokens=20, ignore_eos=True))] = 2
            for o in eng.step():
                if o.token_id is not None:
                    out[names[o.seq_id]].append(o.token_id)
                done += o.finished
            if done == 3:
                break
        return out

    eng = engine(loopy, SpeculativeConfig(), max_prefill_tokens=16)
    assert drive(eng) == drive(engine(loopy, max_prefill_tokens=16))
    assert eng.stats.spec.accepted_tokens > 0


def test_engine_spec_never_preempts_for_a_draft(loopy: LlamaModel) -> None:
    """With blocks for the answers only (38 needed, 39 held), drafts shrink to the free blocks and
    nothing is preempted; with fewer blocks, preemption by recompute keeps the tokens too."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for blocks in (39, 30):
        plain = engine(loopy, num_blocks=blocks, enable_prefix_cache=False)
        ref = run(plain, PROMPTS, params)
        eng = engine(loopy, SpeculativeConfig(max_draft=8), num_blocks=blocks, enable_prefix_cache=False)
        assert run(eng, PROMPTS, params) == ref
        assert eng.blocks.num_free == eng.blocks.num_blocks
        if blocks == 39:
            assert eng.stats.preemptions == plain.stats.preemptions == 0
        else:
            assert eng.stats.preemptions > 0


def test_draft_len_pays_for_itself() -> None:
    assert draft_len(0.5, 0.0, 4) == 4  # free rows: always the longest draft
    assert draft_len(0.0, 0.0, 4) == 0  # nothing is ever accepted
    assert draft_len(0.5, 0.75, 4) == 0  # 1.5 tokens for 1.75 steps
    assert draft_len(0.95, 0.75, 8) > 0
    assert draft_len(0.9, 0.05, 8) == 8
    for a in (0.3, 0.6, 0.9):
        for c in (0.1, 0.5, 1.0):
            k = draft_len(a, c, 6)
            value = [sum(a ** i for i in range(j + 1)) / (1 + c * j) for j in range(7)]
            assert value[k] == pytest.approx(max(value))


def test_engine_spec_cost_gate(model: LlamaModel, loopy: LlamaModel) -> None:
    """With a row cost, a sequence whose drafts fail mostly decodes plainly (probing now and then),
    one whose drafts succeed keeps drafting; tokens stay the plain engine's."""
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    gated = SpeculativeConfig(row_cost=0.5, probe_every=4)
    for m in (model, loopy):
        ref = run(engine(m), PROMPTS, params)
        always, eng = engine(m, SpeculativeConfig()), engine(m, gated)
        assert run(always, PROMPTS, params) == ref
        assert run(eng, PROMPTS, params) == ref
        if m is model:  # drafts of a random model are almost never accepted
            assert eng.stats.spec.draft_tokens < always.stats.spec.draft_tokens / 2
        else:
            assert eng.stats.spec.accepted_tokens > 0
            assert eng.stats.spec.accepted_tokens / eng.stats.spec.draft_tokens >= (
                always.stats.spec.accepted_tokens / always.stats.spec.draft_tokens)


def test_engine_spec_config_checks(model: LlamaModel) -> None:
    with pytest.raises(ValueError, match="overlap"):
        engine(model, SpeculativeConfig(), overlap=True)
    with pytest.raises(ValueError, match="overlap"):
        engine(model, SpeculativeConfig()).set_overlap(True)
