"""A linear layer with an optional int8 weight-only mode for fast CPU decode.

Decoding one token is a chain of matrix-vector products, bound by how many weight bytes
stream from memory: int8 weights (per-output-channel scales) move a quarter of fp32's
bytes. The int8 path runs through `aten._weight_int8pack_mm` with bf16 activations (the
kernel's fast path on AVX-512 CPUs) and casts the result back to the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    @classmethod
    def wrap(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """A Linear sharing an existing weight tensor (tied embeddings)."""
        lin = cls.__new__(cls)
        nn.Module.__init__(lin)
        lin.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        lin.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        lin.qweight = None
        lin.scales = None
        return lin

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            assert self.scales is not None
            y = torch.ops.aten._weight_int8pack_mm(x.to(self.scales.dtype), self.qweight, self.scales).to(x.dtype)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
