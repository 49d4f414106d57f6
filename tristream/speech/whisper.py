"""Compact Whisper encoder/decoder that loads HF weights, with a static-KV decoder step.

The encoder runs on any padded length up to 30 s (positional embeddings sliced, as whisper.cpp's
`audio_ctx`), so streaming updates encode a short fixed bucket instead of 30 s. The decoder
works on static buffers: a parallel prefill writes positions `0..P-1`, then each step writes one
position per sequence (device tensors, so steps are CUDA-graph capturable and sequences may sit
at different positions). `alignment_logits` re-runs a finished sequence teacher-forced and returns
the alignment heads' cross-attention (word times by DTW, see `timing.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tristream.engine.models.layers import Layers
from tristream.speech import kernels
from tristream.speech.config import ALIGNMENT_HEADS, PRESETS, WhisperDims
from tristream.speech.errors import AudioInputError, WhisperWeightsError


def _fused_qkv(state: dict[str, torch.Tensor], p: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.cat([state[p + "q_proj.weight"], state[p + "k_proj.weight"], state[p + "v_proj.weight"]])
    bq, bv = state[p + "q_proj.bias"], state[p + "v_proj.bias"]
    return w, torch.cat([bq, torch.zeros_like(bq), bv])


class _Block(nn.Module):
    """What both layer kinds hold: self-attention (`ln1`, fused `qkv`, `out`) and, registered by the
    subclass after its own modules, the GELU MLP (`ln2`, `fc1`, `fc2`)."""

    def __init__(self, dims: WhisperDims) -> None:
        super().__init__()
        d = dims.d_model
        self.heads = dims.heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def _add_mlp(self, dims: WhisperDims) -> None:
        self.ln2 = nn.LayerNorm(dims.d_model)
        self.fc1 = nn.Linear(dims.d_model, dims.ffn)
        self.fc2 = nn.Linear(dims.ffn, dims.d_model)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the MLP."""
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class EncoderLayer(_Block):
    """Pre-norm self-attention + GELU MLP block."""

    def __init__(self, dims: WhisperDims) -> None:
        super().__init__(dims)
        self._add_mlp(dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        return self._mlp(x + self.out(a.transpose(1, 2).reshape(b, n, d)))

    def forward_fused(self, x: torch.Tensor, h: torch.Tensor, next_ln: nn.LayerNorm, gelu_epilogue: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` given `h = ln1(x)`, each residual add fused with the layer norm after it
        (speech/kernels.py) → `(x, next_ln(x))`. gelu_epilogue: fc1's GELU in its GEMM (`gelu_linear`)."""
        b, n, d = x.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        x, h = kernels.add_layer_norm(x, self.out(a.transpose(1, 2).reshape(b, n, d)), self.ln2)
        f = kernels.gelu_linear(h, self.fc1.weight, self.fc1.bias) if gelu_epilogue else F.gelu(self.fc1(h))
        return kernels.add_layer_norm(x, self.fc2(f), next_ln)


class DecoderLayer(_Block):
    """Causal self-attention (static cache) + cross-attention + MLP."""

    def __init__(self, dims: WhisperDims) -> None:
        super().__init__(dims)
        d = dims.d_model
        self.lnx = nn.LayerNorm(d)
        self.xq = nn.Linear(d, d)
        self.xout = nn.Linear(d, d)
        self._add_mlp(dims)

    def self_attend(self, x: torch.Tensor, kv_cache: torch.Tensor, kv_index: tuple[torch.Tensor, ...],
                    mask: torch.Tensor) -> torch.Tensor:
        """Residual stream after causal self-attention; writes this step's K/V into the cache.

        `kv_cache` `[2, B, H, Tmax, hd]`; `kv_index` (sequence `[B,1,1]`, head `[1,H,1]`, position
        `[B,1,S]`) indexes where this step's K/V go (one scatter, per-sequence positions); `mask`
        additive `[B, 1, S, Tmax]`.
        """
        b, s, d = x.shape
        h, hd = self.heads, d // self.heads
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, h, hd).permute(2, 0, 3, 1, 4)
        seq, head, pos = kv_index
        kv_cache[:, seq, head, pos] = qkv[1:]
        a = F.scaled_dot_product_attention(qkv[0], kv_cache[0], kv_cache[1], attn_mask=mask)
        return x + self.out(a.transpose(1, 2).reshape(b, s, d))

    def cross_query(self, x: torch.Tensor) -> torch.Tensor:
        """Cross-attention queries `[B, H, S, hd]`."""
        return self._heads(self.xq(self.lnx(x)))

    def _heads(self, q: torch.Tensor) -> torch.Tensor:
        b, s, d = q.shape
        return q.view(b, s, self.heads, d // self.heads).transpose(1, 2)

    # ---- the same with the step kernels (speech/kernels.py): `h` is the layer norm of `x` that the
    # next sub-block needs, computed with the residual add that made `x` (one kernel, not two)
    def self_attend_fused(self, x: torch.Tensor, h: torch.Tensor, kv_cache: torch.Tensor, pos: torch.Tensor,
                          mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`self_attend` given `h = ln1(x)`; `pos` `[B, S]` cache positions → `(x, lnx(x))`."""
        b, s, d = x.shape
        h_, hd = self.heads, d // self.heads
        qkv = self.qkv(h).view(b, s, 3, h_, hd)
        kernels.write_kv(kv_cache, qkv, pos)
        q = qkv[:, :, 0].transpose(1, 2)
        a = F.scaled_dot_product_attention(q, kv_cache[0], kv_cache[1], attn_mask=mask)
        return kernels.add_layer_norm(x, self.out(a.transpose(1, 2).reshape(b, s, d)), self.lnx)

    def rest_fused(self, x: torch.Tensor, h: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor,
                   next_ln: nn.LayerNorm, q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention and MLP given `h = lnx(x)` (and the cross queries `q` when the caller
        has them) → `(x, next_ln(x))`."""
        b, s, d = x.shape
        q = self._heads(self.xq(h)) if q is None else q
        a = F.scaled_dot_product_attention(q, xk, xv)
        x, h = kernels.add_layer_norm(x, self.xout(a.transpose(1, 2).reshape(b, s, d)), self.ln2)
        return kernels.add_layer_norm(x, self.fc2(F.gelu(self.fc1(h))), next_ln)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, kv_index: tuple[torch.Tensor, ...], xk: torch.Tensor,
                xv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x `[B, S, D]`; see `self_attend` for the cache arguments; cross K/V `[B, H, T, hd]`."""
        b, s, d = x.shape
        x = self.self_attend(x, kv_cache, kv_index, mask)
        a = F.scaled_dot_product_attention(self.cross_query(x), xk, xv)
        return self._mlp(x + self.xout(a.transpose(1, 2).reshape(b, s, d)))


@dataclass(slots=True)
class DecoderCache:
    """Static decoder buffers: self K/V `[L, 2, B, H, Tmax, hd]`, cross K|V `[B, T, L, 2, H, hd]`.

    The cross K|V is a contiguous view of the flat buffer `xflat`, laid out as the fused cross
    projection's output (`Whisper.fill_cross`: one GEMM writes it, no copy); `cross(i)` gives layer
    i's K and V as `[B, H, T, hd]` views. `rows(b, t)` views the first `b * t` positions of `xflat`
    as `[b, t, ...]`, so for a fixed `t` stream row r sits at the same place for every `b` (a
    smaller batch bucket sees the first rows of a larger one). `mask` is the additive causal table
    `[Tmax, Tmax]` (row p: 0 for positions ≤ p, -inf after); `seq_idx` `[B, 1, 1]` and `head_idx`
    `[1, H, 1]` index the self K/V's sequence and head axes.
    """

    kv: torch.Tensor
    xkv: torch.Tensor
    xflat: torch.Tensor
    mask: torch.Tensor
    seq_idx: torch.Tensor
    head_idx: torch.Tensor

    def rows(self, batch: int, enc_len: int) -> DecoderCache:
        """View of the first `batch` sequences and `enc_len` encoder positions (for shape buckets)."""
        per = self.xkv.shape[2:]
        n = batch * enc_len * math.prod(per)
        if n > self.xflat.numel() or batch > self.kv.shape[2]:
            raise AudioInputError(f"cache holds {self.kv.shape[2]} sequences x {self.xkv.shape[1]} encoder positions; "
                                  f"asked for {batch} x {enc_len}")
        return DecoderCache(self.kv[:, :, :batch], self.xflat[:n].view(batch, enc_len, *per), self.xflat, self.mask,
                            self.seq_idx[:batch], self.head_idx)

    def cross(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s cross-attention K and V, `[B, H, T, hd]` views."""
        x = self.xkv[:, :, layer]
        return x[:, :, 0].transpose(1, 2), x[:, :, 1].transpose(1, 2)

    @property
    def max_len(self) -> int:
        return int(self.mask.shape[0])


class Whisper(nn.Module):
    """Whisper encoder + decoder with HF-compatible weights."""

    def __init__(self, dims: WhisperDims) -> None:
        super().__init__()
        self.dims = dims
        d = dims.d_model
        self.conv1 = nn.Conv1d(dims.n_mels, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.enc_pos = nn.Parameter(torch.zeros(dims.max_source_positions, d))
        self.enc_layers = Layers[EncoderLayer](EncoderLayer(dims) for _ in range(dims.encoder_layers))
        self.enc_ln = nn.LayerNorm(d)
        self.tok = nn.Parameter(torch.zeros(dims.vocab_size, d))
        self.dec_pos = nn.Parameter(torch.zeros(dims.max_target_positions, d))
        self.dec_layers = Layers[DecoderLayer](DecoderLayer(dims) for _ in range(dims.decoder_layers))
        self.dec_ln = nn.LayerNorm(d)
        # cross-attention K|V projections of all decoder layers as one GEMM: `fill_cross` writes the
        # whole cross cache in one call straight into its buffer (per-layer projections + permuted
        # copies cost 2 copy kernels per layer per pass)
        self.xkv = nn.Linear(d, dims.decoder_layers * 2 * d)
        # Word times come from the cross-attention of these (layer, head) pairs: OpenAI's published
        # alignment heads for the released checkpoints, else every head of the second half (their default).
        self.alignment_heads: tuple[tuple[int, int], ...] = default_alignment_heads(dims)
        self._head_idx: dict[tuple[int, tuple[int, ...], str], torch.Tensor] = {}
        # fused encode on CUDA (fp16/bf16): convolutions as GEMMs and every GELU in a GEMM epilogue
        # (`_conv_gemms`, `gelu_linear`); False: cuDNN convolutions and separate exact GELUs
        self.gemm_front = True
        self._conv_mats: tuple[object, tuple[torch.Tensor, torch.Tensor]] | None = None

    # ---- encoder ---------------------------------------------------------------------------
    def encode(self, mel: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """`[B, n_mels, 2T]` log-mel (T ≤ 1500) → `[B, T, D]`. `fused`: residual adds fused with the
        layer norms after them (speech/kernels.py; same results within fp rounding)."""
        if mel.dim() != 3 or mel.shape[1] != self.dims.n_mels or mel.shape[2] % 2:
            raise AudioInputError(
                f"mel must be [B, {self.dims.n_mels}, even frames]; got {tuple(mel.shape)}")
        t = mel.shape[2] // 2
        if t > self.dims.max_source_positions:
            raise AudioInputError(f"{mel.shape[2]} mel frames exceed the model's 30 s window "
                                  f"({2 * self.dims.max_source_positions}); split the audio")
        gemm = fused and self.gemm_front and mel.is_cuda and mel.dtype in (torch.float16, torch.bfloat16)
        if gemm:
            # the two convolutions as GEMMs over im2col rows, GELU in their epilogues, time-major
            # throughout; positions added in the first layer norm's kernel
            x = self._conv_gemms(mel)
            x, h = kernels.add_layer_norm(x, self.enc_pos[:t].to(x.dtype), self.enc_layers[0].ln1)
            for i, layer in enumerate(self.enc_layers):
                nxt = self.enc_layers[i + 1].ln1 if i + 1 < len(self.enc_layers) else self.enc_ln
                x, h = layer.forward_fused(x, h, nxt, gelu_epilogue=True)
            return h
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        # pos first: the sum takes the first operand's (contiguous) layout; `x + pos` kept the transposed
        # one, and every layer after it paid strided residual adds and a copy before each layer norm
        x = self.enc_pos[:t].to(x.dtype) + x
        if fused:
            h = self.enc_layers[0].ln1(x)
            for i, layer in enumerate(self.enc_layers):
                nxt = self.enc_layers[i + 1].ln1 if i + 1 < len(self.enc_layers) else self.enc_ln
                x, h = layer.forward_fused(x, h, nxt)
            return h
        for layer in self.enc_layers:
            x = layer(x)
        return self.enc_ln(x)

    def _conv_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """conv1/conv2 weights as `[D, 3·C]` GEMM matrices (tap-major, as the im2col rows), made once
        per weight tensor (remade if the weights are replaced or changed in place)."""
        key = tuple((w.data_ptr(), w._version, w.dtype) for w in (self.conv1.weight, self.conv2.weight))
        if self._conv_mats is None or self._conv_mats[0] != key:
            w1, w2 = (w.detach().permute(0, 2, 1).reshape(w.shape[0], -1).contiguous()
                      for w in (self.conv1.weight, self.conv2.weight))
            self._conv_mats = (key, (w1, w2))
        return self._conv_mats[1]

    def _conv_gemms(self, mel: torch.Tensor) -> torch.Tensor:
        """gelu(conv2(gelu(conv1(mel)))) as `[B, T, D]` through two GEMMs: each output frame's 3 input
        frames (zero-padded at both ends; conv2 strided by 2) side by side as one im2col row."""
        w1, w2 = self._conv_weights()
        b, c, t2 = mel.shape
        xp = F.pad(mel.transpose(1, 2), (0, 0, 1, 1))  # [B, 2T + 2, C], time-major, one copy
        cols = xp.as_strided((b, t2, 3 * c), (xp.stride(0), c, 1)).reshape(b * t2, 3 * c)
        assert self.conv1.bias is not None and self.conv2.bias is not None
        y = kernels.gelu_linear(cols, w1, self.conv1.bias)
        d, t = y.shape[1], t2 // 2
        yp = F.pad(y.view(b, t2, d), (0, 0, 1, 1))
        cols = yp.as_strided((b, t, 3 * d), (yp.stride(0), 2 * d, 1)).reshape(b * t, 3 * d)
        return kernels.gelu_linear(cols, w2, self.conv2.bias).view(b, t, d)

    # ---- decoder ---------------------------------------------------------------------------
    def new_cache(self, batch: int, enc_len: int, max_len: int, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> DecoderCache:
        """Empty static buffers for `batch` sequences of up to `max_len` decoder positions."""
        dims = self.dims
        device = device if device is not None else self.tok.device
        dtype = dtype or self.tok.dtype
        shp = (dims.decoder_layers, 2, batch, dims.heads, max_len, dims.head_dim)
        per = (dims.decoder_layers, 2, dims.heads, dims.head_dim)
        z = torch.zeros
        ar = torch.arange(max_len, device=device)
        mask = torch.zeros(max_len, max_len, device=device, dtype=dtype)
        mask.masked_fill_(ar[None, :] > ar[:, None], float("-inf"))
        xflat = z(batch * enc_len * math.prod(per), device=device, dtype=dtype)
        return DecoderCache(z(shp, device=device, dtype=dtype), xflat.view(batch, enc_len, *per), xflat, mask,
                            torch.arange(batch, device=device)[:, None, None],
                            torch.arange(dims.heads, device=device)[None, :, None])

    def fill_cross(self, enc: torch.Tensor, cache: DecoderCache) -> None:
        """Write the cross-attention K/V of `enc` `[B, T, D]` into `cache` (its first B rows and T positions).

        When the cache view is exactly `[B, T, ...]` (the runner's buckets, `new_cache(B, T, ...)`) the
        fused projection's GEMM writes into it directly."""
        b, t, d = enc.shape
        dst = cache.xkv
        if tuple(dst.shape[:2]) == (b, t) and dst.is_contiguous():
            torch.addmm(self.xkv.bias, enc.reshape(b * t, d), self.xkv.weight.T, out=dst.view(b * t, -1))
        else:
            dst[:b, :t].copy_(self.xkv(enc).view(b, t, *dst.shape[2:]))

    def _embed(self, tokens: torch.Tensor, pos: torch.Tensor, cache: DecoderCache
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        b, s = tokens.shape
        if pos.dim() == 1:
            pos = pos.expand(b, s)
        kv_index = (cache.seq_idx[:b], cache.head_idx, pos[:, None, :])
        mask = cache.mask.index_select(0, pos.reshape(-1)).view(b, 1, s, cache.max_len)
        x = F.embedding(tokens, self.tok) + F.embedding(pos, self.dec_pos).to(self.tok.dtype)
        return x, kv_index, mask

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, cache: DecoderCache, vocab_limit: int | None = None,
               logits_from: int = 0, fused: bool = False) -> torch.Tensor:
        """Tokens `[B, S]` at positions `pos` (`[S]` shared, or `[B, S]` per sequence) → logits.

        Writes the self-attention cache at `pos`; each query attends to cache positions ≤ its own.
        Logits `[B, S - logits_from, V]`: only queries from `logits_from` on (a prefill needs the last
        ones); `vocab_limit` keeps only the first ids (text tokens), a smaller final matmul. `fused`:
        the step kernels of `speech/kernels.py` (same results within fp rounding; torch ops where
        Triton cannot run).
        """
        # The output projection covers a multiple of 8 ids (then sliced back): a row length of
        # 50258 (multilingual `sot`) made cuBLAS fall back to 2-element-aligned kernels, on the H200
        # 97 µs for a 16-stream prefill's logits and 20 µs per decoder step.
        lim = None if vocab_limit is None else min(-(-vocab_limit // 8) * 8, self.tok.shape[0])
        w = self.tok if lim is None else self.tok[:lim]
        if fused:
            x, h, pos2, mask = self._embed_fused(tokens, pos, cache)
            for i, layer in enumerate(self.dec_layers):
                nxt = self.dec_layers[i + 1].ln1 if i + 1 < len(self.dec_layers) else self.dec_ln
                x, h = layer.self_attend_fused(x, h, cache.kv[i], pos2, mask)
                x, h = layer.rest_fused(x, h, *cache.cross(i), nxt)
            return (h[:, logits_from:] @ w.T)[..., :vocab_limit]
        x, kv_index, mask = self._embed(tokens, pos, cache)
        for i, layer in enumerate(self.dec_layers):
            x = layer(x, cache.kv[i], kv_index, *cache.cross(i), mask)
        x = self.dec_ln(x[:, logits_from:])
        return (x @ w.T)[..., :vocab_limit]

    def _embed_fused(self, tokens: torch.Tensor, pos: torch.Tensor, cache: DecoderCache
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Embeddings `x`, the first layer's `ln1(x)`, positions `[B, S]` and the additive mask."""
        b, s = tokens.shape
        pos = pos.expand(b, s) if pos.dim() == 1 else pos
        mask = cache.mask.index_select(0, pos.reshape(-1)).view(b, 1, s, cache.max_len)
        x, h = kernels.embed_layer_norm(tokens, pos, self.tok, self.dec_pos, self.dec_layers[0].ln1)
        return x, h, pos, mask

    def alignment_logits(self, tokens: torch.Tensor, cache: DecoderCache, fused: bool = False) -> torch.Tensor:
        """Teacher-forced pass over `tokens` `[B, S]` (positions 0..S-1) → scaled cross-attention
        logits of `self.alignment_heads`, `[B, n_heads, S, T]` (pre-softmax). Overwrites the cache.
        `fused`: as `decode`."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        if fused:
            return self._alignment_logits_fused(tokens, pos, cache)
        x, kv_index, mask = self._embed(tokens, pos, cache)
        b, s, d = x.shape
        last = max(layer for layer, _ in self.alignment_heads)
        out: list[torch.Tensor] = []
        for i in range(last + 1):
            layer = self.dec_layers[i]
            x = layer.self_attend(x, cache.kv[i], kv_index, mask)
            q = layer.cross_query(x)
            xk, xv = cache.cross(i)
            out += self._head_logits(i, q, xk)
            if i < last:
                a = F.scaled_dot_product_attention(q, xk, xv)
                x = layer._mlp(x + layer.xout(a.transpose(1, 2).reshape(b, s, d)))
        return torch.cat(out, dim=1)

    def _alignment_logits_fused(self, tokens: torch.Tensor, pos: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        x, h, pos2, mask = self._embed_fused(tokens, pos, cache)
        last = max(layer for layer, _ in self.alignment_heads)
        out: list[torch.Tensor] = []
        for i in range(last + 1):
            layer = self.dec_layers[i]
            x, h = layer.self_attend_fused(x, h, cache.kv[i], pos2, mask)
            q = layer._heads(layer.xq(h))
            xk, xv = cache.cross(i)
            out += self._head_logits(i, q, xk)
            if i < last:
                x, h = layer.rest_fused(x, h, xk, xv, self.dec_layers[i + 1].ln1, q)
        return torch.cat(out, dim=1)

    def _head_logits(self, i: int, q: torch.Tensor, xk: torch.Tensor) -> list[torch.Tensor]:
        """Scaled query·key logits of layer `i`'s alignment heads (none: an empty list)."""
        hd = self.dims.head_dim
        heads = [h for li, h in self.alignment_heads if li == i]
        if not heads:
            return []
        lo, hi = min(heads), max(heads) + 1
        qh, kh = q[:, lo:hi], xk[:, lo:hi]  # a contiguous run of heads: views, no gather
        if hi - lo != len(heads):
            sel = self._head_index(i, heads, q.device)
            qh, kh = q.index_select(1, sel), xk.index_select(1, sel)
        return [(qh @ kh.transpose(-1, -2)) * (hd**-0.5)]

    def _head_index(self, layer: int, heads: list[int], device: torch.device) -> torch.Tensor:
        """Index tensor of `heads`, made once per device (never inside a CUDA-graph capture)."""
        key = (layer, tuple(heads), str(device))
        t = self._head_idx.get(key)
        if t is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("alignment head index first needed inside a graph capture; run the pass "
                                   "eagerly once before capturing (WhisperRunner.capture does)")
            t = self._head_idx[key] = torch.tensor(heads, device=device)
        return t

    def decode_full(self, tokens: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        """Reference: logits of a whole token sequence `[B, S]` with fresh buffers (HF-comparable)."""
        b, s = tokens.shape
        cache = self.new_cache(b, enc.shape[1], s, device=enc.device, dtype=enc.dtype)
        self.fill_cross(enc, cache)
        return self.decode(tokens, torch.arange(s, device=tokens.device), cache)


def default_alignment_heads(dims: WhisperDims) -> tuple[tuple[int, int], ...]:
    """OpenAI's alignment heads when `dims` is a released multilingual size, else the second half's heads."""
    for name, heads in ALIGNMENT_HEADS.items():
        if PRESETS[name] == dims:
            return heads
    return tuple((layer, h) for layer in range(dims.decoder_layers // 2, dims.decoder_layers)
                 for h in range(dims.heads))


def load_whisper(dims: WhisperDims, state: dict[str, torch.Tensor]) -> Whisper:
    """Build a `Whisper` from an HF `WhisperForConditionalGeneration` state dict."""
    pfx = next((p for p in ("model.", "") if p + "encoder.conv1.weight" in state), None)
    if pfx is None:
        raise WhisperWeightsError("no encoder.conv1.weight: not a Whisper checkpoint")
    e, dcd = pfx + "encoder.", pfx + "decoder."
    sd: dict[str, torch.Tensor] = {}
    xkv_w: list[torch.Tensor] = []  # cross K|V of every decoder layer, fused (Whisper.xkv)
    xkv_b: list[torch.Tensor] = []
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

        def block(o: str, s: str) -> None:  # `_Block`: self-attention and MLP
            lin(o + "ln1", s + "self_attn_layer_norm")
            lin(o + "ln2", s + "final_layer_norm")
            lin(o + "out", s + "self_attn.out_proj")
            lin(o + "fc1", s + "fc1")
            lin(o + "fc2", s + "fc2")
            sd[o + "qkv.weight"], sd[o + "qkv.bias"] = _fused_qkv(state, s + "self_attn.")

        for i in range(dims.encoder_layers):
            block(f"enc_layers.{i}.", f"{e}layers.{i}.")
        for i in range(dims.decoder_layers):
            s, o = f"{dcd}layers.{i}.", f"dec_layers.{i}."
            block(o, s)
            lin(o + "lnx", s + "encoder_attn_layer_norm")
            lin(o + "xout", s + "encoder_attn.out_proj")
            lin(o + "xq", s + "encoder_attn.q_proj")
            xkv_w += [state[s + "encoder_attn.k_proj.weight"], state[s + "encoder_attn.v_proj.weight"]]
            bv = state[s + "encoder_attn.v_proj.bias"]
            xkv_b += [torch.zeros_like(bv), bv]
        sd["xkv.weight"], sd["xkv.bias"] = torch.cat(xkv_w), torch.cat(xkv_b)
    except KeyError as err:
        raise WhisperWeightsError(f"Whisper checkpoint lacks {err.args[0]!r}") from None
    model = Whisper(dims)
    model.load_state_dict(sd, strict=True)
    return model
