"""A linear layer with an optional int8 weight-only mode for fast CPU decode.

Decoding one token is a chain of matrix-vector products, bound by how many weight bytes
stream from memory: int8 weights (per-output-channel scales) move a quarter of fp32's
bytes. The int8 path runs through `aten._weight_int8pack_mm` with bf16 activations (the
kernel's fast path on AVX-512 CPUs) and casts the result back to the model dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

_prefill_mode: contextvars.ContextVar[bool] = contextvars.ContextVar("prefill_mode", default=False)


@contextlib.contextmanager
def prefill_mode() -> Iterator[None]:
    """Within this block, layers with a dense prefill copy use it (prefill chunks of any size),
    so prefix-cache hits and chunking never change which weights computed a position."""
    token = _prefill_mode.set(True)
    try:
        yield
    finally:
        _prefill_mode.reset(token)


class Linear(nn.Module):
    """y = x W^T (+ b); W is [out, in] like torch.nn.Linear."""

    def __init__(
        self, out_features: int, in_features: int, bias: bool = False,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        self.qweight: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.q4: torch.Tensor | None = None
        self.q4_scales_zeros: torch.Tensor | None = None
        self.q4_group = 32
        self.prefill_weight: torch.Tensor | None = None

    @classmethod
    def wrap(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """A Linear sharing an existing weight tensor (tied embeddings)."""
        lin = cls.__new__(cls)
        nn.Module.__init__(lin)
        lin.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        lin.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        lin.qweight = None
        lin.scales = None
        lin.q4 = None
        lin.q4_scales_zeros = None
        lin.q4_group = 32
        lin.prefill_weight = None
        return lin

    def keep_prefill_copy(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Keep a dense copy for many-row products (prefill), where quantised kernels are slow.

        Call before quantising. bf16 GEMMs run on the AVX-512 BF16 units; decode keeps the
        quantised weights, whose smaller size is what sets its speed.
        """
        self.prefill_weight = self.weight.detach().to(dtype).contiguous()

    def quantize_int8(self, compute_dtype: torch.dtype = torch.bfloat16, keep_dense: bool = False) -> None:
        """Add an int8 copy of the weight with one scale per output channel (symmetric).

        keep_dense=False frees the float weight (unless it is shared, as tied embeddings are).
        """
        w = self.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scale.to(compute_dtype)
        if not keep_dense:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def quantize_int4(self, group: int = 32) -> None:
        """Asymmetric 4-bit weights, one (scale, min) per group of `group` inputs (CPU kernel).

        On weights dequantised from GGUF Q4_1 (which sets each 32-block's min and max to
        codes 0 and 15) this recovers the file's own grid, so no error is added beyond bf16 scales.
        """
        w = self.weight.detach().float()
        n, k = w.shape
        if k % group:
            raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group}")
        wg = w.view(n, k // group, group)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = (hi - lo).clamp(min=1e-10) / 15
        q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        self.q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
        self.q4_scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)
        self.q4_group = group
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prefill_weight is not None and _prefill_mode.get():
            y = F.linear(x.to(self.prefill_weight.dtype), self.prefill_weight).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.q4 is not None:
            assert self.q4_scales_zeros is not None
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.q4, self.q4_group, self.q4_scales_zeros
            ).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.qweight is not None:
            assert self.scales is not None
            y = torch.ops.aten._weight_int8pack_mm(x.to(self.scales.dtype), self.qweight, self.scales).to(x.dtype)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
