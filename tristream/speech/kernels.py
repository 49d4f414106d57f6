"""Triton kernels for the Whisper decoder's launch-bound small ops (a 16-stream step is ~80 kernels).

At batch 16 a decoder step's kernels each take a few µs and the GPU idles between them, so the
step costs about its kernel count. Here: residual add + LayerNorm as one kernel (the torch path
runs an add, then a layer norm), token + position embedding + LayerNorm as one (two gathers, an
add, a layer norm), the self-attention K/V write as one copy kernel (was `index_put`, ~6 µs),
and argmax over the vocabulary split over many programs (torch's one-block-per-row reduce took
18 µs for 16 rows x 51,865), optionally with the greedy step's bookkeeping (token column, next
input, position) in its second stage.

Each function has a torch twin (`*_torch`): the reference the tests compare against, and what
runs where Triton cannot (`enabled(t)` false: a CPU tensor without TRITON_INTERPRET=1). Sums are
fp32, rounded to the tensor's dtype where torch rounds (the residual sum), so the residual stream
is bit-identical to torch's and the normed output within one rounding of it; argmax is exact
(first index on ties, NaN counts as the largest, as `torch.argmax`). Integer arguments are not
specialised: one compile serves every bucket, so no compile is first needed inside a graph capture.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from tristream.engine.optional_triton import tl, triton

ARGMAX_BLOCK = 1024  # vocabulary entries per first-stage program (51,865 → 51 programs per row)


def gelu_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`gelu(x @ wᵀ + bias)` with the GELU in the GEMM's epilogue (cuBLASLt, CUDA fp16/bf16).

    cuBLASLt's GELU is the tanh approximation; Whisper's is the erf form. In fp16 the two differ by
    about the rounding of the result (relative 3.6e-4 over Whisper-tiny's fc1 output on the H200,
    bench/whisper_encode.py), and the epilogue saves the GELU's pass over the activations (fc1:
    20 + 17 µs → 24 µs at 16 × 500 rows). Elsewhere: the exact form, unfused."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        y = torch._addmm_activation(bias, x2, w.t(), use_gelu=True)
    else:
        y = F.gelu(F.linear(x2, w, bias))
    return y.view(*x.shape[:-1], w.shape[0])


def available() -> bool:
    """Whether Triton is installed (kernels run on a GPU, or on a CPU under TRITON_INTERPRET=1)."""
    return triton is not None


def enabled(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on `t`'s device here."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# ---- torch twins (reference and CPU path) ------------------------------------------------------
def add_layer_norm_torch(x: torch.Tensor, y: torch.Tensor, ln: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + y
    return s, ln(s)


def embed_layer_norm_torch(tokens: torch.Tensor, pos: torch.Tensor, tok_w: torch.Tensor, pos_w: torch.Tensor,
                           ln: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    x = F.embedding(tokens, tok_w) + F.embedding(pos.expand(tokens.shape), pos_w).to(tok_w.dtype)
    return x, ln(x)


def write_kv_torch(cache: torch.Tensor, qkv: torch.Tensor, pos: torch.Tensor) -> None:
    b = qkv.shape[0]
    seq = torch.arange(b, device=qkv.device)[:, None, None]
    head = torch.arange(qkv.shape[3], device=qkv.device)[None, :, None]
    cache[:, seq, head, pos.expand(b, qkv.shape[1])[:, None, :]] = qkv.permute(2, 0, 3, 1, 4)[1:]


# ---- kernels ----------------------------------------------------------------------------------
if triton is not None:

    _BIG = tl.constexpr(2**31 - 1)  # no index: beyond any vocabulary

    @triton.jit
    def _norm(s, m, n, w_ptr, b_ptr, offs, eps):
        mean = tl.sum(s, 0) / n
        c = tl.where(m, s - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(c * c, 0) / n + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
        return c * rstd * w + b

    @triton.jit(do_not_specialize=["n", "sx", "sy", "ss", "sh", "eps"])
    def _add_ln_kernel(x_ptr, y_ptr, w_ptr, b_ptr, s_ptr, h_ptr, n, sx, sy, ss, sh, eps,
                       BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * sy + offs, mask=m, other=0.0).to(tl.float32)
        s = (x + y).to(s_ptr.dtype.element_ty)  # rounded as torch's add rounds: the residual stream is exact
        tl.store(s_ptr + row * ss + offs, s, mask=m)
        h = _norm(s.to(tl.float32), m, n, w_ptr, b_ptr, offs, eps)
        tl.store(h_ptr + row * sh + offs, h.to(h_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["rows", "n", "sx", "sy", "ss", "sh", "y_mod", "eps"])
    def _add_ln_rows_kernel(x_ptr, y_ptr, w_ptr, b_ptr, s_ptr, h_ptr, rows, n, sx, sy, ss, sh, y_mod,
                            eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """`_add_ln_kernel` over ROWS rows per program; y's row is the row index mod `y_mod` (a
        `[T, D]` table added to every `T`-row block, e.g. positions to each sequence)."""
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = tl.arange(0, BLOCK)
        cm = offs < n
        m = (r < rows)[:, None] & cm[None, :]
        x = tl.load(x_ptr + r[:, None] * sx + offs[None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + (r % y_mod)[:, None] * sy + offs[None, :], mask=m, other=0.0).to(tl.float32)
        s = (x + y).to(s_ptr.dtype.element_ty)  # rounded as torch's add rounds: the residual stream is exact
        tl.store(s_ptr + r[:, None] * ss + offs[None, :], s, mask=m)
        sf = s.to(tl.float32)
        mean = tl.sum(sf, 1) / n
        c = tl.where(m, sf - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(c * c, 1) / n + eps)
        w = tl.load(w_ptr + offs, mask=cm, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=cm, other=0.0).to(tl.float32)
        h = c * rstd[:, None] * w[None, :] + b[None, :]
        tl.store(h_ptr + r[:, None] * sh + offs[None, :], h.to(h_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["n", "s_len", "st_b", "st_s", "sp_b", "sp_s", "stw", "spw", "eps"])
    def _embed_ln_kernel(t_ptr, p_ptr, tw_ptr, pw_ptr, w_ptr, b_ptr, x_ptr, h_ptr, n, s_len,
                         st_b, st_s, sp_b, sp_s, stw, spw, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        bi = row // s_len
        si = row % s_len
        tok = tl.load(t_ptr + bi * st_b + si * st_s).to(tl.int64)
        pos = tl.load(p_ptr + bi * sp_b + si * sp_s).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < n
        a = tl.load(tw_ptr + tok * stw + offs, mask=m, other=0.0).to(tl.float32)
        p = tl.load(pw_ptr + pos * spw + offs, mask=m, other=0.0).to(tw_ptr.dtype.element_ty).to(tl.float32)
        x = (a + p).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * n + offs, x, mask=m)
        h = _norm(x.to(tl.float32), m, n, w_ptr, b_ptr, offs, eps)
        tl.store(h_ptr + row * n + offs, h.to(h_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["c_kv", "c_b", "c_h", "c_t", "q_b", "q_s", "q_3", "q_h", "p_b", "p_s", "s_len",
                                   "heads"])
    def _kv_write_kernel(c_ptr, c_kv, c_b, c_h, c_t, q_ptr, q_b, q_s, q_3, q_h, p_ptr, p_b, p_s, s_len,
                         heads, HD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        bi = row // s_len
        si = row % s_len
        pos = tl.load(p_ptr + bi * p_b + si * p_s).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < 2 * heads * HD
        kv = offs // (heads * HD)
        hh = (offs // HD) % heads
        d = offs % HD
        v = tl.load(q_ptr + bi * q_b + si * q_s + (1 + kv) * q_3 + hh * q_h + d, mask=m)
        tl.store(c_ptr + kv * c_kv + bi * c_b + hh * c_h + pos * c_t + d, v, mask=m)

    @triton.jit
    def _best(val, idx, m):
        """(value, first index) of the largest valid entry; NaN beats everything (as torch.argmax)."""
        nan = (val != val) & m
        nan_idx = tl.min(tl.where(nan, idx, _BIG), 0)
        v = tl.where(nan | (m == 0), float("-inf"), val)
        mx = tl.max(v, 0)
        first = tl.min(tl.where((v == mx) & m & (nan == 0), idx, _BIG), 0)
        has_nan = nan_idx < _BIG
        return tl.where(has_nan, float("nan"), mx), tl.where(has_nan, nan_idx, first)

    @triton.jit(do_not_specialize=["v", "sr", "nsplit"])
    def _argmax_part_kernel(x_ptr, v, sr, val_ptr, idx_ptr, nsplit, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        offs = part * BLOCK + tl.arange(0, BLOCK)
        m = offs < v
        x = tl.load(x_ptr + row * sr + offs, mask=m, other=0.0).to(tl.float32)
        best, at = _best(x, offs, m)
        tl.store(val_ptr + row * nsplit + part, best)
        tl.store(idx_ptr + row * nsplit + part, at)

    @triton.jit(do_not_specialize=["nsplit", "so", "n_prompt", "k", "t_max"])
    def _argmax_final_kernel(val_ptr, idx_ptr, nsplit, out_ptr, so, tok_ptr, pos_ptr, n_prompt, k, t_max,
                             BLOCK: tl.constexpr, STEP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < nsplit
        val = tl.load(val_ptr + row * nsplit + offs, mask=m, other=0.0)
        idx = tl.load(idx_ptr + row * nsplit + offs, mask=m, other=_BIG)
        _, at = _best(val, idx, m)
        at = at.to(tl.int64)
        if STEP:  # the greedy step's bookkeeping: token into its column (k = overflow), next input, position
            pos = tl.load(pos_ptr + row)
            col = tl.minimum(pos - n_prompt + 1, k)
            tl.store(out_ptr + row * so + col, at)
            tl.store(tok_ptr + row, at)
            tl.store(pos_ptr + row, tl.minimum(pos + 1, t_max - 1))
        else:
            tl.store(out_ptr + row * so, at)


# ---- wrappers -----------------------------------------------------------------------------------
def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """`t` as `[rows, D]` with unit last stride and one row stride, or None."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def _ln_warps(block: int) -> int:
    return 1 if block <= 256 else 2 if block <= 1024 else 4


ADD_LN_ROWS = (4, 2)
"""(rows per program, warps) of `add_layer_norm` from `ADD_LN_MIN_ROWS` rows on. Whisper-tiny's
16 × 500 encoder rows (384 wide) on the H200 (bench/results/whisper_encode_round.json): one row
per program with 2 warps 11.6 µs, 1 row / 1 warp 10.3, 4 rows / 2 warps 10.5, 8 / 4 11.2, 16 / 8
15.5, 32 / 8 21.2. The many-rows kernel also takes a position table (the encoder's first norm)."""
ADD_LN_MIN_ROWS = 256


def add_layer_norm(x: torch.Tensor, y: torch.Tensor, ln: nn.LayerNorm,
                   rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = x + y`, `h = ln(s)` in one kernel → `(s, h)` (new contiguous tensors shaped as `x`).

    `y` may also be a `[T, D]` table with `x` `[..., T, D]`: it is added to every T-row block
    (positional embeddings). rows: (rows per program, warps); None: one row per program below
    `ADD_LN_MIN_ROWS` rows, else `ADD_LN_ROWS`."""
    x2, y2 = _rows(x), _rows(y)
    table = y.dim() == 2 and x.dim() >= 2 and x.shape[-2:] == y.shape and x.shape != y.shape
    if not enabled(x) or x2 is None or y2 is None or (x.shape != y.shape and not table) or x.dtype != y.dtype:
        return add_layer_norm_torch(x, y, ln)  # `x + y` broadcasts a table too
    n = x.shape[-1]
    s = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    h = torch.empty_like(s)
    block = triton.next_power_of_2(n)
    n_rows = x2.shape[0]
    if rows is None and n_rows < ADD_LN_MIN_ROWS and not table:
        _add_ln_kernel[(n_rows,)](x2, y2, ln.weight, ln.bias, s, h, n, x2.stride(0), y2.stride(0), n, n,
                                  float(ln.eps), BLOCK=block, num_warps=_ln_warps(block))
        return s, h
    per, warps = rows or ADD_LN_ROWS
    _add_ln_rows_kernel[(triton.cdiv(n_rows, per),)](
        x2, y2, ln.weight, ln.bias, s, h, n_rows, n, x2.stride(0), y2.stride(0), n, n, y2.shape[0], float(ln.eps),
        ROWS=per, BLOCK=block, num_warps=warps)
    return s, h


def embed_layer_norm(tokens: torch.Tensor, pos: torch.Tensor, tok_w: torch.Tensor, pos_w: torch.Tensor,
                     ln: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """`x = tok_w[tokens] + pos_w[pos]`, `h = ln(x)` in one kernel → `(x, h)`, `[B, S, D]`.

    `tokens` `[B, S]`; `pos` `[B, S]` or broadcastable to it (e.g. `[S]`)."""
    if not enabled(tokens) or tok_w.stride(-1) != 1 or pos_w.stride(-1) != 1:
        return embed_layer_norm_torch(tokens, pos, tok_w, pos_w, ln)
    b, s_len = tokens.shape
    pe = pos.expand(b, s_len)
    n = tok_w.shape[1]
    x = torch.empty(b, s_len, n, device=tok_w.device, dtype=tok_w.dtype)
    h = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    _embed_ln_kernel[(b * s_len,)](tokens, pe, tok_w, pos_w, ln.weight, ln.bias, x, h, n, s_len, tokens.stride(0),
                                   tokens.stride(1), pe.stride(0), pe.stride(1), tok_w.stride(0), pos_w.stride(0),
                                   float(ln.eps), BLOCK=block, num_warps=_ln_warps(block))
    return x, h


def write_kv(cache: torch.Tensor, qkv: torch.Tensor, pos: torch.Tensor) -> None:
    """Write this call's K/V into the self-attention cache, one copy kernel (not an `index_put`).

    `cache` `[2, B, H, Tmax, hd]`; `qkv` `[B, S, 3, H, hd]` (the fused projection's output; K and V
    are `[:, :, 1]` and `[:, :, 2]`); `pos` `[B, S]` (or broadcastable): the cache position of each
    query. Positions must be distinct within a row (they are: prefill 0..S-1, a step one each)."""
    b, s_len, three, heads, hd = qkv.shape
    pe = pos.expand(b, s_len)
    if not enabled(qkv) or cache.stride(-1) != 1 or qkv.stride(-1) != 1 or hd & (hd - 1):
        write_kv_torch(cache, qkv, pe)
        return
    block = triton.next_power_of_2(2 * heads * hd)
    _kv_write_kernel[(b * s_len,)](cache, cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), qkv,
                                   qkv.stride(0), qkv.stride(1), qkv.stride(2), qkv.stride(3), pe, pe.stride(0),
                                   pe.stride(1), s_len, heads, HD=hd, BLOCK=block,
                                   num_warps=4 if block >= 1024 else 2)


def _argmax_parts(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    rows, v = x2.shape
    nsplit = triton.cdiv(v, ARGMAX_BLOCK)
    val = torch.empty(rows, nsplit, device=x2.device, dtype=torch.float32)
    idx = torch.empty(rows, nsplit, device=x2.device, dtype=torch.int32)
    _argmax_part_kernel[(rows, nsplit)](x2, v, x2.stride(0), val, idx, nsplit, BLOCK=ARGMAX_BLOCK, num_warps=4)
    return val, idx, nsplit


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` (int64, shape `x.shape[:-1]`): first index of the largest entry, NaN largest."""
    x2 = _rows(x)
    if not enabled(x) or x2 is None or x.shape[-1] == 0:
        return x.argmax(-1)
    val, idx, nsplit = _argmax_parts(x2)
    out = torch.empty(x2.shape[0], device=x.device, dtype=torch.long)
    _argmax_final_kernel[(x2.shape[0],)](val, idx, nsplit, out, 1, out, out, 0, 0, 0,
                                         BLOCK=triton.next_power_of_2(nsplit), STEP=False, num_warps=1)
    return out.view(x.shape[:-1])


def greedy_step_torch(logits: torch.Tensor, out_tok: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor,
                      n_prompt: int, k: int, t_max: int) -> None:
    nxt = logits.argmax(-1)
    col = (pos - n_prompt + 1).clamp_(max=k)
    out_tok.scatter_(1, col[:, None], nxt[:, None])
    tok.copy_(nxt)
    pos.add_(1).clamp_(max=t_max - 1)


def greedy_step(logits: torch.Tensor, out_tok: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor,
                n_prompt: int, k: int, t_max: int) -> None:
    """One greedy step's tail, in place: `nxt = logits.argmax(-1)` (`logits` `[B, V]`) goes to
    `out_tok[b, min(pos[b] - n_prompt + 1, k)]` and `tok[b]`; `pos[b]` advances (clamped at
    `t_max - 1`). Two kernels (torch: argmax and five small ops)."""
    x2 = _rows(logits)
    if (not enabled(logits) or x2 is None or not (tok.is_contiguous() and pos.is_contiguous())
            or out_tok.stride(1) != 1):
        greedy_step_torch(logits, out_tok, tok, pos, n_prompt, k, t_max)
        return
    val, idx, nsplit = _argmax_parts(x2)
    _argmax_final_kernel[(x2.shape[0],)](val, idx, nsplit, out_tok, out_tok.stride(0), tok, pos, n_prompt, k, t_max,
                                         BLOCK=triton.next_power_of_2(nsplit), STEP=True, num_warps=1)
