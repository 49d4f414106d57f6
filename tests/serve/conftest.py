from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def pipeline_models() -> Any:
    """The real pipeline models (loaded once for every serving test that needs them)."""
    pytest.importorskip("faster_whisper")
    pytest.importorskip("piper")
    from tests.serve.pipeline_helpers import load_models

    return load_models()
