from __future__ import annotations

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with `int(array_of_shape_(1,))`, which
    numpy >= 2.4 refuses ("only 0-dimensional arrays ..."): loops with runtime bounds then fail.
    Under TRITON_INTERPRET=1 only, convert through the array's single element instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor: object, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))  # type: ignore[attr-defined]

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_scalar_index()


@pytest.fixture(scope="session")
def vad():
    """Silero VAD (the stages' and the serving tests' voice detector), loaded once."""
    from tests.models import load_or_skip
    from tristream.stages.vad import SileroVAD

    return load_or_skip(SileroVAD)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marker gpu)")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if interpret and "interpret_ok" in item.keywords:
            continue  # Triton kernels on CPU through the interpreter
        if "gpu" in item.keywords:
            item.add_marker(skip)
