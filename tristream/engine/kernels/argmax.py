"""Greedy tokens: argmax over the vocabulary of each row of float logits, in one Triton kernel.

`torch.argmax` reduces a row in one thread block: on the H200 a [1, 49152] float32 row took
13.9 µs, most of an overlapped SmolLM2-135M decode step's time outside its graph
(bench/results/step_overlap_mlp.json). Here the row is split into BLOCK-sized chunks, one
program each; every program writes its chunk's (max, first index of the max) and counts itself
in a per-row counter, and the last program of the row to finish merges the partials and
resets the counter (the pattern of the split attention merge in `triton_ops`). Ties go to the
first index, as in torch. NaN logits are not handled (torch would return a NaN's index).

The counters and partials are kept per device and CUDA stream and reused: calls on one stream
are ordered, and two streams (two engines in one process) get their own.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _argmax_kernel(x_ptr, pv_ptr, pi_ptr, cnt_ptr, out_ptr, ids_ptr, N, stride, CHUNKS: tl.constexpr,
                   CP2: tl.constexpr, BLOCK: tl.constexpr, IDS: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + offs, mask=offs < N, other=-float("inf")).to(tl.float32)
    mx = tl.max(x, 0)
    idx = tl.min(tl.where(x == mx, offs, N), 0)
    tl.store(pv_ptr + row * CHUNKS + c, mx)
    tl.store(pi_ptr + row * CHUNKS + c, idx)
    # the row's last program merges: barrier, then a release/acquire count at GPU scope
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    if done == CHUNKS - 1:
        tl.debug_barrier()
        k = tl.arange(0, CP2)
        v = tl.load(pv_ptr + row * CHUNKS + k, mask=k < CHUNKS, other=-float("inf"), cache_modifier=".cg")
        i = tl.load(pi_ptr + row * CHUNKS + k, mask=k < CHUNKS, other=N, cache_modifier=".cg")
        best = tl.max(v, 0)
        tok = tl.min(tl.where(v == best, i, N), 0)
        tl.store(out_ptr + row, tok.to(tl.int64))
        if IDS:
            tl.store(ids_ptr + row, tok.to(tl.int32))
        tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")  # ready for the next call


_state: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _buffers(device: torch.device, rows: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    st = _state.get(key)
    if st is None or st[0].numel() < rows or st[1].numel() < rows * chunks:
        n = max(rows, 256)
        st = (torch.zeros(n, dtype=torch.int32, device=device),
              torch.empty(n * chunks, dtype=torch.float32, device=device),
              torch.empty(n * chunks, dtype=torch.int32, device=device))
        _state[key] = st
    return st


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of a 2-D float tensor → int64 [rows] (first index on ties).
    One Triton kernel on CUDA; `torch.argmax` elsewhere, for empty rows and during CUDA graph
    capture (the counters are not graph-safe)."""
    if logits.dim() != 2:
        raise ValueError(f"greedy_tokens takes [rows, vocab] logits, got shape {tuple(logits.shape)}")
    rows, n = logits.shape
    on_gpu = logits.device.type == "cuda"
    if ((not on_gpu and os.environ.get("TRITON_INTERPRET") != "1") or rows == 0 or n == 0 or logits.stride(1) != 1
            or (on_gpu and torch.cuda.is_current_stream_capturing())):
        return logits.argmax(dim=-1)
    chunks = triton.cdiv(n, BLOCK)
    cnt, pv, pi = _buffers(logits.device, rows, chunks)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _argmax_kernel[(rows, chunks)](logits, pv, pi, cnt, out, out, n, logits.stride(0), CHUNKS=chunks,
                                   CP2=triton.next_power_of_2(chunks), BLOCK=BLOCK, IDS=False)
    return out


class GraphArgmax:
    """Greedy tokens inside a CUDA graph: buffers of its own (made before capture, the counters
    reset by the kernel itself), so that every replay computes the argmax of its rows into `out`
    (int64) and also into `ids` (int32: the next decode step's input ids, `graphs.DecodeGraphs`)."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.chunks = triton.cdiv(vocab, BLOCK)
        self.vocab = vocab
        self.cnt = torch.zeros(rows, dtype=torch.int32, device=device)
        self.pv = torch.empty(rows * self.chunks, dtype=torch.float32, device=device)
        self.pi = torch.empty(rows * self.chunks, dtype=torch.int32, device=device)
        self.out = torch.zeros(rows, dtype=torch.int64, device=device)

    def __call__(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """argmax of each row of `logits` [rows, vocab] (any float dtype, unit stride) into `out`
        and `ids` [rows] (int32); returns `out`."""
        rows, n = logits.shape
        if n != self.vocab or rows != self.out.numel() or logits.stride(1) != 1:
            raise ValueError(f"GraphArgmax for [{self.out.numel()}, {self.vocab}] got {tuple(logits.shape)}")
        if ids.dtype != torch.int32 or ids.numel() != rows:
            raise ValueError(f"ids must be int32 [{rows}], got {ids.dtype} {tuple(ids.shape)}")
        _argmax_kernel[(rows, self.chunks)](logits, self.pv, self.pi, self.cnt, self.out, ids, n, logits.stride(0),
                                            CHUNKS=self.chunks, CP2=triton.next_power_of_2(self.chunks), BLOCK=BLOCK,
                                            IDS=True)
        return self.out
