"""Compact Whisper encoder/decoder that loads HF weights, with a static-KV decoder step.

The encoder runs on any padded length up to 30 s (positional embeddings sliced, as whisper.cpp's
`audio_ctx`), so streaming updates encode a short fixed bucket instead of 30 s. The decoder
works on static buffers: a parallel prefill of the prompt writes positions `0..P-1`, then each
`step` writes one position (a device scalar, so the step is CUDA-graph capturable) and returns
logits plus the encoder frame the alignment layers' cross-attention points at (word times).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tristream.engine.speech.config import WhisperDims
from tristream.engine.speech.errors import AudioInputError, WhisperWeightsError


def _fused_qkv(state: dict[str, torch.Tensor], p: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.cat([state[p + "q_proj.weight"], state[p + "k_proj.weight"], state[p + "v_proj.weight"]])
    bq, bv = state[p + "q_proj.bias"], state[p + "v_proj.bias"]
    return w, torch.cat([bq, torch.zeros_like(bq), bv])


class EncoderLayer(nn.Module):
    """Pre-norm self-attention + GELU MLP block."""

    def __init__(self, dims: WhisperDims) -> None:
        super().__init__()
        d = dims.d_model
        self.heads = dims.heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, dims.ffn)
        self.fc2 = nn.Linear(dims.ffn, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class DecoderLayer(nn.Module):
    """Causal self-attention (static cache) + cross-attention + MLP."""

    def __init__(self, dims: WhisperDims) -> None:
        super().__init__()
        d = dims.d_model
        self.heads = dims.heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.lnx = nn.LayerNorm(d)
        self.xq = nn.Linear(d, d)
        self.xkv = nn.Linear(d, 2 * d)
        self.xout = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, dims.ffn)
        self.fc2 = nn.Linear(dims.ffn, d)

    def cross_kv(self, enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention K, V `[B, H, T, hd]` of encoder output."""
        b, t, d = enc.shape
        k, v = self.xkv(enc).view(b, t, 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return k, v

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, pos: torch.Tensor, xk: torch.Tensor,
                xv: torch.Tensor, self_mask: torch.Tensor, want_align: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x `[B, S, D]` at positions `pos` `[S]`; `kv_cache` `[2, B, H, Tmax, hd]` is written in place.

        With `want_align` the cross-attention is computed explicitly and its head-averaged
        probabilities `[B, S, T]` are returned (word timing); otherwise one fused SDPA call.
        """
        b, s, d = x.shape
        h, hd = self.heads, d // self.heads
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, h, hd).permute(2, 0, 3, 1, 4)
        kv_cache.index_copy_(3, pos, qkv[1:])
        a = F.scaled_dot_product_attention(qkv[0], kv_cache[0], kv_cache[1], attn_mask=self_mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        q = self.xq(self.lnx(x)).view(b, s, h, hd).transpose(1, 2)
        probs: torch.Tensor | None = None
        if want_align:
            p = torch.softmax((q @ xk.transpose(-1, -2)) * (hd**-0.5), dim=-1)
            a = p @ xv
            probs = p.mean(dim=1)
        else:
            a = F.scaled_dot_product_attention(q, xk, xv)
        x = x + self.xout(a.transpose(1, 2).reshape(b, s, d))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x, probs


@dataclass(slots=True)
class DecoderCache:
    """Static decoder buffers: self K/V `[L, 2, B, H, Tmax, hd]`, cross K/V `[L, B, H, T, hd]`, causal table."""

    kv: torch.Tensor
    xk: torch.Tensor
    xv: torch.Tensor
    causal: torch.Tensor  # [Tmax, Tmax] bool: row p allows positions <= p

    def rows(self, batch: int, enc_len: int) -> DecoderCache:
        """View of the first `batch` sequences and `enc_len` encoder positions (for shape buckets)."""
        return DecoderCache(self.kv[:, :, :batch], self.xk[:, :batch, :, :enc_len], self.xv[:, :batch, :, :enc_len],
                            self.causal)


class Whisper(nn.Module):
    """Whisper encoder + decoder with HF-compatible weights."""

    def __init__(self, dims: WhisperDims) -> None:
        super().__init__()
        self.dims = dims
        d = dims.d_model
        self.conv1 = nn.Conv1d(dims.n_mels, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.enc_pos = nn.Parameter(torch.zeros(dims.max_source_positions, d))
        self.enc_layers = nn.ModuleList(EncoderLayer(dims) for _ in range(dims.encoder_layers))
        self.enc_ln = nn.LayerNorm(d)
        self.tok = nn.Parameter(torch.zeros(dims.vocab_size, d))
        self.dec_pos = nn.Parameter(torch.zeros(dims.max_target_positions, d))
        self.dec_layers = nn.ModuleList(DecoderLayer(dims) for _ in range(dims.decoder_layers))
        self.dec_ln = nn.LayerNorm(d)
        # Word times come from one mid-late decoder layer's cross-attention (OpenAI's alignment heads
        # sit in the second half); the other layers use fused attention.
        self.align_layers: tuple[int, ...] = ((2 * dims.decoder_layers) // 3,)

    # ---- encoder ---------------------------------------------------------------------------
    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """`[B, n_mels, 2T]` log-mel (T ≤ 1500) → `[B, T, D]`."""
        if mel.dim() != 3 or mel.shape[1] != self.dims.n_mels or mel.shape[2] % 2:
            raise AudioInputError(
                f"mel must be [B, {self.dims.n_mels}, even frames]; got {tuple(mel.shape)}")
        t = mel.shape[2] // 2
        if t > self.dims.max_source_positions:
            raise AudioInputError(f"{mel.shape[2]} mel frames exceed the model's 30 s window "
                                  f"({2 * self.dims.max_source_positions}); split the audio")
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.enc_pos[:t].to(x.dtype)
        for layer in self.enc_layers:
            x = layer(x)
        return self.enc_ln(x)

    # ---- decoder ---------------------------------------------------------------------------
    def new_cache(self, batch: int, enc_len: int, max_len: int, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> DecoderCache:
        """Empty static buffers for `batch` sequences."""
        dims = self.dims
        device = device if device is not None else self.tok.device
        dtype = dtype or self.tok.dtype
        shp = (dims.decoder_layers, 2, batch, dims.heads, max_len, dims.head_dim)
        xshp = (dims.decoder_layers, batch, dims.heads, enc_len, dims.head_dim)
        z = torch.zeros
        ar = torch.arange(max_len, device=device)
        return DecoderCache(z(shp, device=device, dtype=dtype), z(xshp, device=device, dtype=dtype),
                            z(xshp, device=device, dtype=dtype), ar[None, :] <= ar[:, None])

    def fill_cross(self, enc: torch.Tensor, cache: DecoderCache) -> None:
        """Write the cross-attention K/V of `enc` into `cache` (first `enc.shape[0]` rows)."""
        b, t = enc.shape[:2]
        for i, layer in enumerate(self.dec_layers):
            k, v = layer.cross_kv(enc)  # type: ignore[operator]
            cache.xk[i, :b, :, :t].copy_(k)
            cache.xv[i, :b, :, :t].copy_(v)

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, cache: DecoderCache, vocab_limit: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `[B, S]` at positions `pos` `[S]` → logits `[B, S, V]`, alignment attention `[B, S, T]`.

        Writes the self-attention cache at `pos`; attends to cache positions ≤ each query's position.
        `vocab_limit` keeps only the first ids' logits (text tokens), a smaller final matmul.
        """
        x = F.embedding(tokens, self.tok) + self.dec_pos.index_select(0, pos).to(self.tok.dtype)
        mask = cache.causal.index_select(0, pos)
        align: torch.Tensor | None = None
        for i, layer in enumerate(self.dec_layers):
            x, p = layer(x, cache.kv[i], pos, cache.xk[i], cache.xv[i], mask, i in self.align_layers)
            if p is not None:
                align = p if align is None else align + p
        x = self.dec_ln(x)
        assert align is not None
        w = self.tok if vocab_limit is None else self.tok[:vocab_limit]
        return x @ w.T, align

    def decode_full(self, tokens: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        """Reference: logits of a whole token sequence `[B, S]` with fresh buffers (HF-comparable)."""
        b, s = tokens.shape
        cache = self.new_cache(b, enc.shape[1], s, device=enc.device, dtype=enc.dtype)
        self.fill_cross(enc, cache)
        return self.decode(tokens, torch.arange(s, device=tokens.device), cache)[0]


def load_whisper(dims: WhisperDims, state: dict[str, torch.Tensor]) -> Whisper:
    """Build a `Whisper` from an HF `WhisperForConditionalGeneration` state dict."""
    pfx = next((p for p in ("model.", "") if p + "encoder.conv1.weight" in state), None)
    if pfx is None:
        raise WhisperWeightsError("no encoder.conv1.weight: not a Whisper checkpoint")
    e, dcd = pfx + "encoder.", pfx + "decoder."
    sd: dict[str, torch.Tensor] = {}
    try:
        for n in ("conv1", "conv2"):
            sd[f"{n}.weight"], sd[f"{n}.bias"] = state[f"{e}{n}.weight"], state[f"{e}{n}.bias"]
        sd["enc_pos"] = state[e + "embed_positions.weight"]
        sd["enc_ln.weight"], sd["enc_ln.bias"] = state[e + "layer_norm.weight"], state[e + "layer_norm.bias"]
        sd["tok"] = state[dcd + "embed_tokens.weight"]
        sd["dec_pos"] = state[dcd + "embed_positions.weight"]
        sd["dec_ln.weight"], sd["dec_ln.bias"] = state[dcd + "layer_norm.weight"], state[dcd + "layer_norm.bias"]

        def lin(ours: str, theirs: str) -> None:
            sd[ours + ".weight"] = state[theirs + ".weight"]
            sd[ours + ".bias"] = state[theirs + ".bias"]

        for i in range(dims.encoder_layers):
            s, o = f"{e}layers.{i}.", f"enc_layers.{i}."
            lin(o + "ln1", s + "self_attn_layer_norm")
            lin(o + "ln2", s + "final_layer_norm")
            lin(o + "out", s + "self_attn.out_proj")
            lin(o + "fc1", s + "fc1")
            lin(o + "fc2", s + "fc2")
            sd[o + "qkv.weight"], sd[o + "qkv.bias"] = _fused_qkv(state, s + "self_attn.")
        for i in range(dims.decoder_layers):
            s, o = f"{dcd}layers.{i}.", f"dec_layers.{i}."
            lin(o + "ln1", s + "self_attn_layer_norm")
            lin(o + "lnx", s + "encoder_attn_layer_norm")
            lin(o + "ln2", s + "final_layer_norm")
            lin(o + "out", s + "self_attn.out_proj")
            lin(o + "xout", s + "encoder_attn.out_proj")
            lin(o + "xq", s + "encoder_attn.q_proj")
            lin(o + "fc1", s + "fc1")
            lin(o + "fc2", s + "fc2")
            sd[o + "qkv.weight"], sd[o + "qkv.bias"] = _fused_qkv(state, s + "self_attn.")
            xk, xv = state[s + "encoder_attn.k_proj.weight"], state[s + "encoder_attn.v_proj.weight"]
            sd[o + "xkv.weight"] = torch.cat([xk, xv])
            bv = state[s + "encoder_attn.v_proj.bias"]
            sd[o + "xkv.bias"] = torch.cat([torch.zeros_like(bv), bv])
    except KeyError as err:
        raise WhisperWeightsError(f"Whisper checkpoint lacks {err.args[0]!r}") from None
    model = Whisper(dims)
    model.load_state_dict(sd, strict=True)
    return model


def load_whisper_folder(folder: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> Whisper:
    """Load an HF Whisper folder (config.json + safetensors)."""
    from tristream.engine.vision.weights import read_config, read_safetensors

    m = load_whisper(WhisperDims.from_hf(read_config(folder)), read_safetensors(folder))
    return m.to(device=device, dtype=dtype)
