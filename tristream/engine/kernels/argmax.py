"""Greedy tokens: argmax over the vocabulary of each row of float logits, in one Triton kernel.

`torch.argmax` reduces a row in one thread block: on the H200 a [1, 49152] float32 row took
13.9 µs, most of an overlapped SmolLM2-135M decode step's time outside its graph
(bench/results/step_overlap_mlp.json at e80efaf). Here the row is split into BLOCK-sized chunks, one
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
def _argmax_kernel(x_ptr, pv_ptr, pi_ptr, cnt_ptr, out_ptr, ids_ptr, host_ptr, calls_ptr, ROWS, N, stride,
                   CHUNKS: tl.constexpr, CP2: tl.constexpr, BLOCK: tl.constexpr, IDS: tl.constexpr,
                   HOST: tl.constexpr):
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
        if HOST:  # into mapped pinned host memory: slot (call number & 1) = [stamp, tokens of the rows]
            c = tl.load(calls_ptr + row) + 1
            base = (c & 1) * (ROWS + 1)
            tl.store(host_ptr + base + 1 + row, tok.to(tl.int64))
            tl.store(host_ptr + base, c.to(tl.int64))
            tl.store(calls_ptr + row, c)
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
    _argmax_kernel[(rows, chunks)](logits, pv, pi, cnt, out, out, out, cnt, rows, n, logits.stride(0),
                                   CHUNKS=chunks, CP2=triton.next_power_of_2(chunks), BLOCK=BLOCK, IDS=False,
                                   HOST=False)
    return out


class GraphArgmax:
    """Greedy tokens inside a CUDA graph: buffers of its own (made before capture, the counters
    reset by the kernel itself), so that every replay computes the argmax of its rows into `out`
    (int64) and also into `ids` (int32: the next decode step's input ids, `graphs.DecodeGraphs`).

    On CUDA the tokens also go straight into pinned host memory (`host`, mapped into the device's
    address space): no device→host copy between two decode graphs (each such copy cost ~10 us of
    GPU time between graphs, bench/results/step_host.json at ccbc598). Two slots alternate, chosen by a
    per-row call counter on the device; call k (counted from 1) writes slot k & 1 as
    [k, token of row 0, row 1, ...]. `calls` mirrors that count on the host: every call and every
    replay of a graph holding one must count itself (`count_replay`), and `check_host` checks the
    stamps, so that a replay that was not counted fails loudly instead of returning another step's
    tokens."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.chunks = triton.cdiv(vocab, BLOCK)
        self.vocab = vocab
        self.rows = rows
        self.cnt = torch.zeros(rows, dtype=torch.int32, device=device)
        self.pv = torch.empty(rows * self.chunks, dtype=torch.float32, device=device)
        self.pi = torch.empty(rows * self.chunks, dtype=torch.int32, device=device)
        self.out = torch.zeros(rows, dtype=torch.int64, device=device)
        self.mapped = device.type == "cuda"
        self.dev_calls = torch.zeros(rows, dtype=torch.int32, device=device)
        # a normal tensor even when made inside inference mode (tests read and reset it)
        with torch.inference_mode(False):
            self.host = torch.zeros(2 * (rows + 1), dtype=torch.int64, pin_memory=self.mapped)
        self.calls = 0

    def __call__(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """argmax of each row of `logits` [rows, vocab] (any float dtype, unit stride) into `out`
        and `ids` [rows] (int32) (and the host slot); returns `out`."""
        rows, n = logits.shape
        if n != self.vocab or rows != self.rows or logits.stride(1) != 1:
            raise ValueError(f"GraphArgmax for [{self.rows}, {self.vocab}] got {tuple(logits.shape)}")
        if ids.dtype != torch.int32 or ids.numel() != rows:
            raise ValueError(f"ids must be int32 [{rows}], got {ids.dtype} {tuple(ids.shape)}")
        host = self.host if self.mapped else self.out
        _argmax_kernel[(rows, self.chunks)](logits, self.pv, self.pi, self.cnt, self.out, ids, host, self.dev_calls,
                                            rows, n, logits.stride(0), CHUNKS=self.chunks,
                                            CP2=triton.next_power_of_2(self.chunks), BLOCK=BLOCK, IDS=True,
                                            HOST=self.mapped)
        if not (self.mapped and torch.cuda.is_current_stream_capturing()):
            self.count_replay()
        return self.out

    def count_replay(self) -> None:
        """Count one run of the kernel (a call outside capture, or a replay of a graph holding it)."""
        self.calls += 1

    def host_tokens(self) -> tuple[torch.Tensor, int]:
        """The pinned host slot the last counted run writes ([rows] int64 view, valid once that run
        is done) and the stamp it writes with them (`check_host`)."""
        if not self.mapped:
            raise RuntimeError("host_tokens needs CUDA (mapped pinned memory)")
        base = (self.calls & 1) * (self.rows + 1)
        return self.host[base + 1:base + 1 + self.rows], self.calls

    def check_host(self, stamp: int) -> None:
        """Raise when the host slot of run `stamp` does not hold that run's tokens: call once that run
        is done. Catches a slot overwritten two runs later, and a run of the kernel that was not
        counted (a replay not made through `graphs._DecodeGraph`) unless the next counted run is
        already launched and not yet done when this is called."""
        r = self.rows + 1
        mine = int(self.host[(stamp & 1) * r])
        other = int(self.host[((stamp + 1) & 1) * r])
        if mine != stamp:
            raise RuntimeError(f"GraphArgmax host slot holds run {mine}, expected run {stamp}: the slot was "
                               "read two runs late, or a replay of a decode graph was not counted")
        if other != stamp - 1 and not (other == stamp + 1 and self.calls > stamp):
            raise RuntimeError(f"GraphArgmax ran {other} times, the host counted {self.calls}: a replay of a "
                               "decode graph was not counted (replay through DecodeGraphs.graphs[b].replay())")
