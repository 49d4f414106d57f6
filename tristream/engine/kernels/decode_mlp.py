"""Batch-1 decode MLP in one kernel: RMSNorm + gate|up GEMV + SiLU·up + down GEMV, split over
the intermediate rows, each program adding its share of the down projection into a float32
residual stream with atomics.

The batch-1 decode layer of `decode_fused.decode_logits_b1` spends two kernels on the MLP
(norm+gate|up, then SiLU+down+residual) because the down projection needs every intermediate
value. Split the other way round, it does not: program p owns intermediate rows
[p·R, (p+1)·R), computes their gate and up values (each program normalises the residual row
itself: it is small and in L2), and multiplies them by its R columns of the down weight, a
partial sum of every output element, which it adds into the residual with `atomic_add`. One
kernel less per layer, at the price of

* a float32 residual stream (the atomics add float32): `decode_logits_b1(mlp=True)` keeps two
  float32 copies `ra`/`rb` of the residual, the output projection writes both, the MLP reads
  `ra` (normalised) and adds into `rb`, the next layer reads `rb`;
* a summation order that depends on which program adds first: two runs of a step can differ
  in the last bits of the float32 residual (not bitwise reproducible, unlike the other paths).

Rounding otherwise follows the unfused path: the normalised row, the gate and up values and
the SiLU·up product are rounded to the weight dtype as torch would round them; the residual is
not (it stays float32), so the logits differ from the bf16-residual paths by the rounding the
residual no longer gets, and the decode graphs accept the variant only where it agrees
(`kernel_choice.variant_agrees`).

Measured on the H200 it does not pay (bench/results/mlp_fuse.json, decode_profile_mlp.json):
alone, SmolLM2-135M's MLP took 5.0 µs either way and Llama-3.2-1B's 36.1 µs (32 rows per
program, the best of 16-128 rows, 4 or 8 warps, either down layout) against 34.1 µs for the
pair: the atomics (programs × hidden float32 adds) cost what the saved boundary gave. In the
decode graph the step got slower (135M 0.433 → 0.482 ms, 1B 0.916 → 1.070 ms), so the decode
graphs do not try it at capture; it stays selectable by name (`graphs.B1_VARIANTS`).

`down_t`: the down weight transposed ([intermediate, hidden], contiguous), so each program's
R columns are R contiguous rows; None reads the R columns of the [hidden, intermediate] weight
directly (R·2 contiguous bytes per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tristream.engine.kernels.gemv import row_rstd
from tristream.engine.kernels.pdl import pdl_mode, pdl_start, pdl_wait


@triton.jit
def _mlp1_kernel(x_ptr, gu_ptr, nw_ptr, dw_ptr, out_ptr, H, INTER, eps, R: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOWN_T: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    pid = tl.program_id(0)
    rr = pid * R + tl.arange(0, R)  # this program's intermediate rows (INTER % R == 0)
    dt = gu_ptr.dtype.element_ty
    rk0 = tl.arange(0, BLOCK_K)
    k0mask = rk0 < H
    # the first K tile of the gate and up rows: constant, so loaded before waiting (PDL)
    wg0 = tl.load(gu_ptr + rr[:, None] * H + rk0[None, :], mask=k0mask[None, :], other=0.0)
    wu0 = tl.load(gu_ptr + (rr + INTER)[:, None] * H + rk0[None, :], mask=k0mask[None, :], other=0.0)
    pdl_wait(USE_PDL)
    rstd = row_rstd(x_ptr, H, eps, BLOCK_K)
    g = tl.zeros([R], dtype=tl.float32)
    u = tl.zeros([R], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < H
        xv = tl.load(x_ptr + rk, mask=kmask, other=0.0)
        nw = tl.load(nw_ptr + rk, mask=kmask, other=0.0)
        xv = ((xv.to(tl.float32) * rstd).to(dt).to(tl.float32) * nw.to(tl.float32)).to(dt).to(tl.float32)
        if k0 == 0:
            wg = wg0
            wu = wu0
        else:
            wg = tl.load(gu_ptr + rr[:, None] * H + rk[None, :], mask=kmask[None, :], other=0.0)
            wu = tl.load(gu_ptr + (rr + INTER)[:, None] * H + rk[None, :], mask=kmask[None, :], other=0.0)
        g += tl.sum(wg.to(tl.float32) * xv[None, :], 1)
        u += tl.sum(wu.to(tl.float32) * xv[None, :], 1)
    g = g.to(dt).to(tl.float32)  # as the gate|up GEMV's output would be rounded
    u = u.to(dt).to(tl.float32)
    act = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
    for n0 in range(0, H, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        nmask = rn < H
        if DOWN_T:
            w = tl.load(dw_ptr + rr[:, None] * H + rn[None, :], mask=nmask[None, :], other=0.0)
            part = tl.sum(w.to(tl.float32) * act[:, None], 0)
        else:
            w = tl.load(dw_ptr + rn[:, None] * INTER + rr[None, :], mask=nmask[:, None], other=0.0)
            part = tl.sum(w.to(tl.float32) * act[None, :], 1)
        tl.atomic_add(out_ptr + rn, part, mask=nmask, sem="relaxed")


def mlp_rows(inter: int, rows: int = 16) -> int:
    """Intermediate rows per program: `rows`, halved until it divides `inter`."""
    r = rows
    while r > 1 and inter % r:
        r //= 2
    return r


def fused_mlp1(x: torch.Tensor, gate_up: torch.Tensor, norm_weight: torch.Tensor, eps: float, down: torch.Tensor,
               out: torch.Tensor, down_t: bool = False, rows: int = 16, block_k: int | None = None,
               block_n: int | None = None, pdl: bool | int = False, num_warps: int = 4) -> None:
    """out += down(silu(gate) · up) of RMSNorm(x), batch 1, in one kernel (see the module doc).

    x: [1, H] (any float dtype; float32 for the residual stream); gate_up: [2I, H] (gate rows
    first); down: [H, I], or [I, H] when `down_t`; out: contiguous float32 [1, H], added into
    in place (it must not be `x`: programs read x while others add into out)."""
    if x.shape[0] != 1 or out.shape[0] != 1:
        raise ValueError(f"fused_mlp1 is the batch-1 kernel; got {x.shape[0]} rows")
    two_i, h = gate_up.shape
    inter = two_i // 2
    if two_i % 2 or x.shape[1] != h or out.shape[1] != h:
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"out {tuple(out.shape)}")
    if tuple(down.shape) != ((inter, h) if down_t else (h, inter)):
        raise ValueError(f"down {tuple(down.shape)} does not fit hidden {h} / intermediate {inter} "
                         f"({'transposed' if down_t else 'as stored'})")
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("out must be a contiguous float32 tensor (the residual stream)")
    if out.data_ptr() == x.data_ptr():
        raise ValueError("out must not alias x")
    r = mlp_rows(inter, rows)
    # tiles of about 8k weights per matrix: registers stay bounded as rows grow
    bk = block_k or min(triton.next_power_of_2(h), max(64, 8192 // r))
    bn = block_n or min(triton.next_power_of_2(h), max(64, 8192 // r))
    _mlp1_kernel[(inter // r,)](
        x, gate_up, norm_weight, down, out, h, inter, eps, R=r, BLOCK_K=bk, BLOCK_N=bn, DOWN_T=down_t,
        USE_PDL=pdl_mode(pdl), num_warps=num_warps, **({"launch_pdl": True} if pdl else {}),
    )
