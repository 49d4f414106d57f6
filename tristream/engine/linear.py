"""A linear layer with optional weight-only quantised modes for CPU inference.

Decoding one token is a chain of matrix-vector products, bound by how many weight bytes
stream from memory. The quantised modes keep GGUF's block formats (32 inputs per block): q4
(4-bit codes with an fp16 scale and minimum, Q4_1's grid) and q8 (8-bit codes with an fp16
scale, Q8_0's grid), run by our native kernels (`tristream/engine/cpu/`), which take float32
activations and return float32 results on every instruction set. Float32 out matters: greedy
decoding takes the argmax of the head's logits, and rounded logits tie (bf16 steps of 0.125
near a logit of 25 made the lowest-id token win a tie that float32 does not have).

A third mode, fp8, is for GPUs: e4m3 weights with one float32 scale per output row
(`quantize_fp8`), run by `kernels/fp8_gemv.py` on CUDA with bf16 activations (the weight is
widened in registers, products summed in float32, the row scale applied to the sums). Without
CUDA the same function runs in torch (`fp8_reference`): the reference of the kernels' tests.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from tristream.engine.cpu.native import Kernels

QBLOCK = 32
FORMATS = ("q4", "q8")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn

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


def quantize_blocks(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """Block-quantise a float weight [N, K] (K a multiple of 32) into `fmt`'s tensors.

    q4: asymmetric, scale (max - min) / 15 and minimum per block, both fp16; on weights
    dequantised from a GGUF Q4_1 file this recovers the file's codes exactly. q8: symmetric,
    scale max|w| / 127 in fp16 (likewise exact for Q8_0).
    """
    w = w.detach().float()
    n, k = w.shape
    if k % QBLOCK:
        raise ValueError(f"in_features {k} is not a multiple of the quantisation block {QBLOCK}")
    wg = w.view(n, k // QBLOCK, QBLOCK)
    if fmt == "q4":
        lo, hi = wg.amin(-1), wg.amax(-1)
        m16 = lo.half()
        d16 = ((hi - m16.float()) / 15).half()
        d = d16.float()
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.round((wg - m16.float()[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
        packed = codes[..., :16] | (codes[..., 16:] << 4)
        return {"w": packed.reshape(n, k // 2).contiguous(), "d": d16.contiguous(), "m": m16.contiguous()}
    if fmt == "q8":
        d16 = (wg.abs().amax(-1) / 127).half()
        d = d16.float()
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.round(wg * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return {"w": codes.reshape(n, k).contiguous(), "d": d16.contiguous()}
    raise ValueError(f"quantised format must be one of {', '.join(FORMATS)}, not {fmt!r}")


def dequantize_blocks(fmt: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight [N, K] that `fmt`'s tensors encode (reference and fallback)."""
    d = t["d"].float()
    if fmt == "q4":
        p = t["w"]
        n = p.shape[0]
        pb = p.view(n, -1, 16)
        codes = torch.cat([pb & 0x0F, pb >> 4], dim=-1).float()  # [N, nb, 32]
        return (codes * d[..., None] + t["m"].float()[..., None]).view(n, -1)
    codes = t["w"].float().view(t["w"].shape[0], -1, QBLOCK)
    return (codes * d[..., None]).view(t["w"].shape[0], -1)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] → (e4m3 codes [N, K], float32 scale per row [N]): each row is scaled
    so that its largest magnitude maps to 448 (the largest e4m3), then rounded to nearest. An
    all-zero row gets scale 1 (codes 0)."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that e4m3 codes and per-row scales encode."""
    return q.float() * scale.float()[:, None]


def fp8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """What the fp8 kernels compute, in torch: x [M, K] times the e4m3 codes [N, K] summed in
    float32, times the row scale, plus bias, rounded to x's dtype."""
    y = F.linear(x.float(), q.float()) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


_KERNELS: list[Kernels | None] = []


def native_kernels() -> Kernels | None:
    """The native kernels for this CPU, loaded once per process (None where they cannot run)."""
    if not _KERNELS:
        from tristream.engine.cpu import native

        _KERNELS.append(native.load())
    return _KERNELS[0]


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
        self._init_quant(out_features, in_features)

    def _init_quant(self, out_features: int, in_features: int) -> None:
        self.out_features, self.in_features = out_features, in_features
        self.qformat: str | None = None
        self.qtensors: dict[str, torch.Tensor] = {}
        self.prefill_weight: torch.Tensor | None = None

    @classmethod
    def wrap(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """A Linear sharing an existing weight tensor (tied embeddings)."""
        lin = cls.__new__(cls)
        nn.Module.__init__(lin)
        lin.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        lin.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        lin._init_quant(weight.shape[0], weight.shape[1])
        return lin

    def keep_prefill_copy(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Keep a dense copy for many-row products (prefill). Call before quantising; only worth
        it where the CPU multiplies `dtype` natively (see `tristream.engine.cpu.features`)."""
        self.prefill_weight = self.weight.detach().to(dtype).contiguous()

    def quantize(self, fmt: str, keep_dense: bool = False) -> None:
        """Replace the float weight by `fmt`'s block-quantised tensors (run by the native kernels).

        keep_dense=True keeps the float weight too (tied embeddings still need it for lookups).
        """
        self.set_quantized(fmt, quantize_blocks(self.weight, fmt), keep_dense)

    def quantize_fp8(self, keep_dense: bool = False) -> None:
        """Replace the weight by e4m3 codes and per-row scales (`quantize_fp8`); keep_dense as
        in `quantize`."""
        q, s = quantize_fp8(self.weight)
        self.set_fp8(q, s, keep_dense)

    def set_fp8(self, q: torch.Tensor, scale: torch.Tensor, keep_dense: bool = False) -> None:
        """Install e4m3 codes [out, in] and float32 scales [out] (from `quantize_fp8` or an FP8
        checkpoint)."""
        if q.dtype != torch.float8_e4m3fn or tuple(q.shape) != (self.out_features, self.in_features):
            raise ValueError(f"fp8 weight must be float8_e4m3fn [{self.out_features}, {self.in_features}], "
                             f"got {q.dtype} {tuple(q.shape)}")
        if tuple(scale.shape) != (self.out_features,):
            raise ValueError(f"fp8 scale must have shape [{self.out_features}], got {tuple(scale.shape)}")
        self.qformat = "fp8"
        self.qtensors = {"w": q.contiguous(), "s": scale.float().to(q.device).contiguous()}
        if not keep_dense:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=q.device),
                                       requires_grad=False)

    def set_quantized(self, fmt: str, tensors: dict[str, torch.Tensor], keep_dense: bool = False) -> None:
        """Install already-quantised tensors (from `quantize_blocks` or a cache)."""
        if fmt not in FORMATS:
            raise ValueError(f"quantised format must be one of {', '.join(FORMATS)}, not {fmt!r}")
        need = {"w", "d", "m"} if fmt == "q4" else {"w", "d"}
        if set(tensors) != need:
            raise KeyError(f"{fmt} needs tensors {sorted(need)}, got {sorted(tensors)}")
        self.qformat = fmt
        self.qtensors = {k: v.contiguous() for k, v in tensors.items()}
        if not keep_dense:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prefill_weight is not None and _prefill_mode.get():
            y = F.linear(x.to(self.prefill_weight.dtype), self.prefill_weight).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.qformat == "fp8":
            return self._fp8(x)
        if self.qformat is not None:
            return self._quantized(x)
        return F.linear(x, self.weight, self.bias)

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:
        q, s = self.qtensors["w"], self.qtensors["s"]
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda:
            from tristream.engine.kernels.fp8_gemv import fp8_linear

            y = fp8_linear(x2, q, s, self.bias)
        else:
            y = fp8_reference(x2, q, s, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        m = x2.shape[0]
        kern = native_kernels()
        t = self.qtensors
        if kern is None or m == 0:  # no native kernels here: the same weights, dequantised
            y = F.linear(x2, dequantize_blocks(self.qformat or "", t))
            if self.bias is not None:
                y = y + self.bias.float()
        else:
            y = torch.empty(m, n, dtype=torch.float32, device=x.device)
            bias = self.bias.float().contiguous() if self.bias is not None else None
            bp = bias.data_ptr() if bias is not None else None
            if self.qformat == "q4":
                rc = kern.lib.ts_linear_q4(x2.data_ptr(), m, k, t["w"].data_ptr(), t["d"].data_ptr(),
                                           t["m"].data_ptr(), n, bp, y.data_ptr())
            else:
                rc = kern.lib.ts_linear_q8(x2.data_ptr(), m, k, t["w"].data_ptr(), t["d"].data_ptr(),
                                           n, bp, y.data_ptr())
            if rc != 0:
                raise MemoryError(f"native {self.qformat} kernel failed for a [{m}, {k}] input")
        y = y.view(*x.shape[:-1], n)
        return y if x.dtype == torch.float32 else y.to(x.dtype)
