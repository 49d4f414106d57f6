"""Token start frames by DTW on the device: one Triton program per stream, inside the align graph.

The host DTW (`timing.dtw_token_starts`, numpy, vectorised over streams) costs one numpy call per
row and step: ~0.6 ms for 16 streams and a 9-row tail, 2.5 ms for 64 (bench/results/encoders_round.json),
more than the alignment pass that feeds it. Here each stream's program walks its rows with the
frames as a vector: row 0 is a prefix sum, every later row a prefix minimum (`tl.associative_scan`)
of the arrival costs, and the backtrace picks, per row, the last minimum of the stored gaps up to
the current frame, exactly as `dtw_token_starts` does. `device_token_starts` adds the anchoring of
`timing.anchored_token_starts` (accepted draft tokens keep their earlier frames, DTW restarts at
the re-timed token's old start) in torch ops, so a pass's frames leave the GPU with its tokens.
"""

from __future__ import annotations

import torch

from tristream.engine.optional_triton import tl, triton


def available() -> bool:
    """Whether the Triton kernel can run here (a GPU, or TRITON_INTERPRET=1 on a CPU)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _min_combine(a, b):
        return tl.minimum(a, b)

    @triton.jit
    def _dtw_kernel(align_ptr, s_b, s_r, r0_ptr, f0_ptr, nr_ptr, nc_ptr, acc_ptr, gap_ptr, ws_b, ws_r,
                    ws_t, out_ptr, out_b, BLOCK_T: tl.constexpr):
        b = tl.program_id(0)
        r0 = tl.load(r0_ptr + b)
        f0 = tl.load(f0_ptr + b)
        nr = tl.load(nr_ptr + b)
        nc = tl.load(nc_ptr + b)
        offs = tl.arange(0, BLOCK_T)
        fm = offs < nc
        wm = offs < ws_t  # workspace rows hold ws_t frames; the block may be wider
        src = align_ptr + b.to(tl.int64) * s_b + r0 * s_r + f0
        acc_w = acc_ptr + b.to(tl.int64) * ws_b
        gap_w = gap_ptr + b.to(tl.int64) * ws_b
        cost = tl.where(fm, -tl.load(src + offs, mask=fm, other=0.0).to(tl.float32), 0.0)
        acc = tl.cumsum(cost, 0)
        tl.store(acc_w + offs, acc, mask=wm)
        for i in range(1, nr):
            tl.debug_barrier()  # row i-1 of acc stored by every thread before the shifted read
            left = tl.load(acc_w + (i - 1) * ws_r + offs - 1, mask=(offs >= 1) & wm, other=0.0)
            arrive = tl.where(offs >= 1, tl.minimum(left, acc), acc)
            cost = tl.where(fm, -tl.load(src + i * s_r + offs, mask=fm, other=0.0).to(tl.float32), 0.0)
            csum = tl.cumsum(cost, 0)
            gap = arrive - csum + cost
            tl.store(gap_w + i * ws_r + offs, gap, mask=wm)
            acc = csum + tl.associative_scan(gap, 0, _min_combine)
            tl.store(acc_w + i * ws_r + offs, acc, mask=wm)
        tl.debug_barrier()
        j = (tl.maximum(nc, 1) - 1).to(tl.int32)
        for k in range(0, nr - 1):
            i = nr - 1 - k
            g = tl.load(gap_w + i * ws_r + offs, mask=wm, other=float("inf"))
            seg = tl.where(offs <= j, g, float("inf"))
            c = tl.max(tl.where(seg == tl.min(seg, 0), offs, -1), 0)  # last minimum: enter late
            a_c = tl.load(acc_w + (i - 1) * ws_r + c)
            a_l = tl.load(acc_w + (i - 1) * ws_r + tl.maximum(c - 1, 0))
            diag = (c > 0) & (a_l <= a_c)
            tl.store(out_ptr + b.to(tl.int64) * out_b + r0 + i, (c + f0).to(tl.int64))
            j = tl.where(diag, c - 1, c)
        tl.store(out_ptr + b.to(tl.int64) * out_b + r0, f0.to(tl.int64))


def dtw_rows(align: torch.Tensor, r0: torch.Tensor, f0: torch.Tensor, n_rows: torch.Tensor, n_cols: torch.Tensor,
             out: torch.Tensor, workspace: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Per stream b: DTW over `align[b, r0:r0+n_rows, f0:f0+n_cols]` (higher = more attention);
    writes the frame (absolute: + f0) where the path enters each row into `out[b, r0:r0+n_rows]`.

    `align` `[B, R, T]` float32 (last dim contiguous); `r0`, `f0`, `n_rows` (≥ 1), `n_cols` (≥ 1):
    `[B]` int64; `out` `[B, ≥ R]` int64; `workspace`: two float32 `[B, R, ≥ T]` scratch tensors
    (contiguous). No host sync, fixed launch shape: capturable in a CUDA graph.
    """
    if triton is None:
        raise RuntimeError("device DTW needs Triton; use the host DTW (WhisperRunner(device_times=False))")
    b, rows, t = align.shape
    acc, gap = workspace
    if acc.shape[0] < b or acc.shape[1] < rows or acc.shape[2] < t or not (acc.is_contiguous() and gap.is_contiguous()):
        raise ValueError(f"workspace {tuple(acc.shape)} too small or not contiguous for align {tuple(align.shape)}")
    if align.stride(-1) != 1:
        raise ValueError("align's last dimension must be contiguous")
    # sized by the workspace, not by this call's frames: one compiled kernel for every audio bucket
    # (a compile first needed inside a CUDA-graph capture would fail)
    block = max(16, triton.next_power_of_2(acc.shape[2]))
    _dtw_kernel[(b,)](align, align.stride(0), align.stride(1), r0, f0, n_rows, n_cols, acc, gap, acc.stride(0),
                      acc.stride(1), acc.shape[2], out, out.stride(0), BLOCK_T=block, num_warps=4 if block <= 512 else 8)


def device_token_starts(align: torch.Tensor, toks: torch.Tensor, eot: int, valid: torch.Tensor, accepted: torch.Tensor,
                        draft_frames: torch.Tensor, n_draft_frames: torch.Tensor, retime: int, out: torch.Tensor,
                        workspace: tuple[torch.Tensor, torch.Tensor]) -> None:
    """`timing.anchored_token_starts` on the device: start frame of every token and of the
    end-of-text row into `out` `[B, K + 1]`.

    `align` `[B, K + 1, T]`; `toks` `[B, K]`; `valid` `[B]` audio frames; `accepted` `[B]` draft
    tokens the pass confirmed; `draft_frames` `[B, D]` the previous pass's frames of the draft (its
    first `n_draft_frames[b]` entries are real; 0 entries: no anchoring).
    """
    bsz, k = toks.shape
    dev = toks.device
    is_eot = toks == eot
    n_text = torch.where(is_eot.any(1), is_eot.long().argmax(1), k)
    valid = valid.clamp(1, align.shape[-1])
    r = torch.minimum(torch.minimum(accepted - retime, n_draft_frames), n_text).clamp_min(0)
    has = r > 0
    at = torch.minimum(r, (n_draft_frames - 1).clamp_min(0))
    dfr = draft_frames.gather(1, at[:, None].clamp_max(draft_frames.shape[1] - 1))[:, 0]
    f0 = torch.where(has, torch.minimum(dfr.clamp_min(0), valid - 1), 0)
    r0 = torch.where(has, r, 0)
    cols = torch.arange(k + 1, device=dev)
    d = min(draft_frames.shape[1], k + 1)
    out.zero_()
    if d:
        head = torch.minimum(draft_frames[:, :d].cummax(1).values, f0[:, None])
        out[:, :d].copy_(torch.where(cols[None, :d] < r0[:, None], head, 0))
    dtw_rows(align, r0, f0, n_text + 1 - r0, valid - f0, out, workspace)
    last = out.gather(1, n_text[:, None])
    out.copy_(torch.where(cols[None, :] > n_text[:, None], last, out))
