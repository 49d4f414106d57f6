"""The engines the scheduled serving stack runs: `build_engine` (a model name, folder or GGUF through
the one engine factory, or a preset shape with random weights) and `load_real_engine`.

The synthetic-plan driver that replays a scheduler's plans on such an engine for `bench/sched.py
--real` lives in `bench/real_backend.py`.
"""

from __future__ import annotations

from typing import Any


def random_llama(name_or_cfg: Any, device: str, dtype: Any) -> Any:
    """A Llama of a preset name (or ModelConfig) with random weights (N(0, 0.02); norms at 1)."""
    import torch

    from tristream.engine.config import preset
    from tristream.engine.models.llama import LlamaModel

    torch.manual_seed(0)
    cfg = preset(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    m = LlamaModel(cfg, dtype=dtype, device=device, max_positions=4096)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in n:
                p.fill_(1.0)
    return m


def build_engine(model: str, device: str, kv_bytes: int, quant: str = "auto") -> Any:
    """An engine for `model`: ``smollm2`` (the embedded GGUF) or a HF folder / GGUF path through the
    one engine factory (`tristream.engine.cli_support.load_engine`); a preset name (``tiny-random``,
    ``llama-3.2-1b``, ... or empty for Llama-3.2-1B) builds that shape with random weights, for benchmarks."""
    import torch

    from tristream.engine.engine import EngineConfig, LLMEngine

    if model == "smollm2" or (model and ("/" in model or model.endswith(".gguf"))):
        return load_real_engine(None if model == "smollm2" else model, device, quant, kv_bytes)
    cfg = EngineConfig(kv_cache_bytes=kv_bytes, max_model_len=4096, use_graphs=device.startswith("cuda"))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    spec: Any = model or "llama-3.2-1b"
    if spec == "tiny-random":  # smoke tests of the --real path on a CPU
        from tristream.engine.config import ModelConfig

        spec = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                           num_kv_heads=2, max_position=4096)
    eng = LLMEngine(random_llama(spec, device, dtype), None, cfg)
    eng.runner.capture()
    return eng


def load_real_engine(model: str | None, device: str, quant: str = "auto", kv_bytes: int | None = None) -> Any:
    """`load_engine(model, device, quant)`, with a KV cache of `kv_bytes` (and graphs on CUDA) when given."""
    from tristream.engine.cli_support import load_engine

    if kv_bytes is None:
        return load_engine(model, device, quant)
    from tristream.engine.engine import EngineConfig

    cfg = EngineConfig(kv_cache_bytes=kv_bytes, max_model_len=4096, use_graphs=device.startswith("cuda"))
    return load_engine(model, device, quant, config=cfg)
