"""Median-of-7 filter along time in one Triton kernel (the alignment matrix's smoothing on a GPU).

`timing.median7` runs the 13 compare-exchanges of a median-of-7 network as 26 elementwise torch
kernels, each reading and writing the whole `[B·heads, rows, T]` block; here each program loads
the 7 shifted windows once, runs the same network in registers and writes the median. The result
is one of the inputs (min/max only), so it equals `median7` and `torch.median` exactly.
"""

from __future__ import annotations

import torch

from tristream.engine.optional_triton import tl, triton

BLOCK = 256


def available() -> bool:
    """Whether the kernel can run here (a GPU, or TRITON_INTERPRET=1 on a CPU)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _cx(a, b):
        return tl.minimum(a, b), tl.maximum(a, b)

    # sizes and strides are not specialised: one compiled kernel serves every audio bucket, so no
    # compile is first needed inside a CUDA-graph capture
    @triton.jit(do_not_specialize=["t", "s_in", "s_out"])
    def _median7_kernel(x_ptr, out_ptr, t, s_in, s_out, BLOCK_T: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        m = offs < t
        src = x_ptr + row * s_in + offs
        p0 = tl.load(src, mask=m, other=0.0)
        p1 = tl.load(src + 1, mask=m, other=0.0)
        p2 = tl.load(src + 2, mask=m, other=0.0)
        p3 = tl.load(src + 3, mask=m, other=0.0)
        p4 = tl.load(src + 4, mask=m, other=0.0)
        p5 = tl.load(src + 5, mask=m, other=0.0)
        p6 = tl.load(src + 6, mask=m, other=0.0)
        # Devillard's network, as timing._MEDIAN7: afterwards p3 holds the median
        p0, p5 = _cx(p0, p5)
        p0, p3 = _cx(p0, p3)
        p1, p6 = _cx(p1, p6)
        p2, p4 = _cx(p2, p4)
        p0, p1 = _cx(p0, p1)
        p3, p5 = _cx(p3, p5)
        p2, p6 = _cx(p2, p6)
        p2, p3 = _cx(p2, p3)
        p3, p6 = _cx(p3, p6)
        p4, p5 = _cx(p4, p5)
        p1, p4 = _cx(p1, p4)
        p1, p3 = _cx(p1, p3)
        p3, p4 = _cx(p3, p4)
        tl.store(out_ptr + row * s_out + offs, p3, mask=m)


def median7_padded(xp: torch.Tensor) -> torch.Tensor:
    """`xp` `[..., T + 6]` (padded by 3 on each side) → `[..., T]`: median of each 7-frame window."""
    if triton is None:
        raise RuntimeError("median7_padded needs Triton; use timing.median7")
    if xp.shape[-1] < 7:
        raise ValueError(f"need at least 7 padded frames, got {xp.shape[-1]}")
    t = xp.shape[-1] - 6
    x2 = xp.reshape(-1, xp.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], t, device=xp.device, dtype=xp.dtype)
    _median7_kernel[(x2.shape[0], triton.cdiv(t, BLOCK))](x2, out, t, x2.stride(0), out.stride(0), BLOCK_T=BLOCK)
    return out.view(*xp.shape[:-1], t)
