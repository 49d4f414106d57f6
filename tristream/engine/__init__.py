"""LLM engine: Llama-family models, paged KV cache, continuous batching, CUDA graphs.

Public API (imported lazily so that `import tristream.engine` stays cheap):
`LLMEngine`, `EngineConfig`, `StepOutput`, `SamplingParams`, `FinishReason`, `AsyncLLM`,
`Delta`, `ModelConfig`, `LlamaModel`, `load_model`, `Tokenizer`, `RetentionConfig` (KV budgets,
`kv_retention.py`). See `engine.engine` for
the incremental-prefill API (`add_request(generate=False)`, `append`, `start_generation`).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLMEngine": "tristream.engine.engine",
    "EngineConfig": "tristream.engine.engine",
    "StepOutput": "tristream.engine.engine",
    "SamplingParams": "tristream.engine.sequence",
    "FinishReason": "tristream.engine.sequence",
    "AsyncLLM": "tristream.engine.async_engine",
    "Delta": "tristream.engine.async_engine",
    "ModelConfig": "tristream.engine.config",
    "LlamaModel": "tristream.engine.models.llama",
    "load_model": "tristream.engine.loader",
    "Tokenizer": "tristream.engine.tokenizer",
    "RetentionConfig": "tristream.engine.kv_retention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tristream.engine' has no attribute {name!r}")
