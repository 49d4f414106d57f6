"""Varlen prefill attention straight over the paged KV cache (Triton, flash-attention style).

One launch per layer serves every prefill chunk of a step, whatever their lengths and cached
prefixes: the host cuts each chunk into tiles of `BLOCK_M` queries, and a program handles one
(tile, KV head) pair. Its rows are the tile's queries × the query heads that share the KV head
(GQA folded into the rows), so each K/V block is loaded once for the whole group. Keys are
read through the chunk's block table (no gather into a dense copy, no mask tensor, no padding
to the longest chunk); the causal limit of query i of a chunk of q_len tokens ending at ctx_len
is key j ≤ ctx_len − q_len + i, so the loop stops at the tile's last query. Softmax is online
(running max and sum in fp32, exp2 with log2 e folded into the scale).

The host plan (`PagedPrefillPlan` in `packed_attention.py`) ships, in the step's one
host→device copy: per tile its chunk and first query; per chunk its first packed row, q_len,
ctx_len and the offset of its block table in a flat array.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 64  # query rows × grouped heads per program
BLOCK_N = 64  # keys per inner iteration


@triton.jit
def _paged_prefill_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, tile_chunk_ptr, tile_m0_ptr, qstart_ptr, qlen_ptr,
                          ctx_ptr, btoff_ptr, bt_ptr, scale_log2,
                          NH: tl.constexpr, NKV: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                          HD: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          IEEE: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    c = tl.load(tile_chunk_ptr + tile)
    m0 = tl.load(tile_m0_ptr + tile)
    q_start = tl.load(qstart_ptr + c)
    q_len = tl.load(qlen_ptr + c)
    ctx = tl.load(ctx_ptr + c)
    bt_off = tl.load(btoff_ptr + c)

    r = tl.arange(0, BLOCK_M * GP)
    m = r // GP  # query within the tile
    g = r % GP  # head within the group
    qi = m0 + m
    row_ok = (qi < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, HD)
    row = (q_start + qi).to(tl.int64)
    q_off = (row * NH + head)[:, None] * HD + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    # padded rows take the chunk's last query's limit, so every row sees key 0 (finite softmax)
    lim = ctx - q_len + tl.minimum(qi, q_len - 1)

    m_i = tl.full([BLOCK_M * GP], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GP, HD], dtype=tl.float32)
    key_end = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M)
    for n0 in range(0, key_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < key_end
        page = tl.load(bt_ptr + bt_off + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = page * PAGE + n % PAGE
        kv_off = (slot * NKV + kvh)[:, None] * HD + d[None, :]
        k = tl.load(kc_ptr + kv_off, mask=n_ok[:, None], other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        s = tl.where((n[None, :] <= lim[:, None]) & n_ok[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + kv_off, mask=n_ok[:, None], other=0.0).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out_ptr + q_off, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def block_m(group: int) -> int:
    """Queries per tile for `group` query heads per KV head (ROWS rows per program)."""
    return max(1, ROWS // triton.next_power_of_2(group))


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            tile_chunk: torch.Tensor, tile_m0: torch.Tensor, q_start: torch.Tensor,
                            q_len: torch.Tensor, ctx_len: torch.Tensor, bt_off: torch.Tensor,
                            block_tables: torch.Tensor, page: int, scale: float) -> torch.Tensor:
    """Causal attention of packed queries q [T, nh, hd] over their chunks' paged contexts.

    k_cache/v_cache: flat [slots, nkv, hd]; the tile arrays come from `PagedPrefillPlan`. The
    keys of positions < ctx_len − q_len must already be in the cache; this chunk's own keys
    too (rope_store writes them first)."""
    t, nh, hd = q.shape
    nkv = k_cache.shape[1]
    group = nh // nkv
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"paged prefill attention needs a power-of-two head_dim >= 16, got {hd}")
    out = torch.empty_like(q)
    n_tiles = tile_chunk.shape[0]
    if n_tiles == 0:
        return out
    gp = triton.next_power_of_2(group)
    _paged_prefill_kernel[(n_tiles, nkv)](
        q, k_cache, v_cache, out, tile_chunk, tile_m0, q_start, q_len, ctx_len, bt_off, block_tables,
        scale * 1.4426950408889634,
        NH=nh, NKV=nkv, GROUP=group, GP=gp, HD=hd, PAGE=page, BLOCK_M=block_m(group), BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2,
    )
    return out
