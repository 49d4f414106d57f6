"""Which decode kernel variants the decode graphs choose from at capture, and how they decide that
one computes the same thing as the cuBLAS path (kept apart from `graphs.py`, which needs Triton,
so that it is tested and named on CPU too)."""

from __future__ import annotations

import torch

CAPTURE_PDL = ("b1_pdl", "bw_pdl", "b1w_pdl", "b8w_pdl_hc", "bw_pdle", "b4w_pdle_ln", "b4w_pdle_ln_hc")
"""The batch-1 variants `DecodeGraphs` times at capture on a GPU with PDL (Hopper and newer): each
one won a model on the H200 or is its nearest rival (b4w_pdle_ln_hc SmolLM2-135M, bw_pdl / b1w_pdl
Llama-3.2-1B, b1_pdl Llama-3-8B; docs/engine-decode.md)."""
CAPTURE_PLAIN = ("b1", "bw", "b1w", "b8w", "b1_hc", "b4w_ln")
"""The same without PDL (before Hopper)."""
B1_VARIANTS = (*CAPTURE_PDL, *CAPTURE_PLAIN)
"""Batch-1 variant names: a `TILES` name, then "_pdl" (chained with PDL: a kernel lets its successor
launch after its wait) or "_pdle" (at its start, `kernels/pdl.py`), then "_ln" (the norms in one
pass, `gemv.fused_gemv`'s late_norm), then "_hc" (the output projection through cuBLAS)."""
VARIANTS = ("cublas", *B1_VARIANTS)
"""Decode kernel variants: cuBLAS GEMMs + fused norms (every bucket); at batch 1 also the
norm+QKV+RoPE+store layer and fused GEMVs (`kernels/decode_fused.py`) in the `B1_VARIANTS`.
Exactly the variants the capture-time choice (`DecodeGraphs._candidates`) can pick."""


def variant_agrees(got: torch.Tensor, ref: torch.Tensor, err: float) -> bool:
    """Whether a kernel variant's logits agree with the cuBLAS path's: relative error under 2%,
    or under 6% with the same greedy token in every row. Two correct bf16 paths that only sum in
    another order drift apart layer by layer: on random-weight 16-30 layer models the H200 showed
    2.0-2.7% (Llama-3.2-1B, SmolLM2-135M), while a wrong kernel (a bad rotation, a stale cache
    row) is off by tens of percent."""
    if err < 2e-2:
        return True
    return err < 6e-2 and bool((got.argmax(-1) == ref.argmax(-1)).all())
