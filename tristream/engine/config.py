"""Model configuration for Llama-family decoders (Llama 2/3.x, SmolLM2, Qwen2/2.5).

One dataclass covers every supported family: the differences are q/k/v biases (Qwen2),
tied embeddings (SmolLM2, Llama-3.2-1B, small Qwen2) and rope scaling (Llama 3.x).
Configs come from a Hugging Face `config.json`, from GGUF metadata, or from the presets
below (used by benchmarks with random weights).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


class UnsupportedModel(ValueError):
    """The checkpoint is not a Llama-family decoder this engine can run."""


SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")


@dataclasses.dataclass(slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    arch: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        emb = self.vocab_size * h
        return self.num_layers * per_layer + emb * (1 if self.tie_word_embeddings else 2) + h

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dictionary."""
        mt = str(cfg.get("model_type", "llama"))
        if mt not in SUPPORTED_ARCHS:
            raise UnsupportedModel(
                f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        eos = cfg.get("eos_token_id")
        eos_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        nh = int(cfg["num_attention_heads"])
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rp = cfg.get("rope_parameters")  # transformers >= 5 folds theta and scaling together
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rope_scaling = dict(rp)
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
            None, "default"
        ):
            rope_scaling = None
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=nh,
            num_kv_heads=int(cfg.get("num_key_value_heads") or nh),
            head_dim=int(cfg.get("head_dim") or 0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", mt == "qwen2")),
            arch=mt,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads(Path(path).read_text()))

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face style `config.json` dictionary (used for the GGUF cache and tests)."""
        d: dict[str, Any] = {
            "model_type": self.arch,
            "architectures": ["Qwen2ForCausalLM" if self.arch == "qwen2" else "LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.arch != "qwen2":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        return d


def preset(name: str) -> ModelConfig:
    """Configs of well-known checkpoints, for benchmarks with random weights."""
    presets: dict[str, ModelConfig] = {
        "smollm2-135m": ModelConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
            num_kv_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0, max_position=8192,
            tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        ),
        "llama-3.2-1b": ModelConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
            num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            max_position=131072, tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,),
        ),
        "llama-3-8b": ModelConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
            num_kv_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, max_position=8192,
            bos_token_id=128000, eos_token_ids=(128001,),
        ),
    }
    if name not in presets:
        raise UnsupportedModel(f"unknown preset {name!r}; known: {', '.join(presets)}")
    return dataclasses.replace(presets[name])
