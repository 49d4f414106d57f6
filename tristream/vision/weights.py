"""Read an HF model folder: `config.json` plus one or many `*.safetensors` files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tristream.vision.errors import VisionWeightsError


def read_config(folder: str | Path) -> dict[str, Any]:
    """The folder's `config.json` as a dict."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise VisionWeightsError(f"{path} not found: pass a Hugging Face model folder (config.json + safetensors)")
    return dict(json.loads(path.read_text()))


def read_safetensors(folder: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files (sharded or not), optionally cast."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise VisionWeightsError(f"no *.safetensors file in {folder}; convert .bin checkpoints first")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            state[k] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
    return state
