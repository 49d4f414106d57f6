"""The native kernels behind the model's elementwise ops and decode attention (float32 on CPU).

A decode step at batch 1 is ~45 small torch ops per layer, each a few microseconds of dispatch;
on a 135M model that is as long as the matrix products. These backends do a layer's norms,
SiLU and rope + cache write + attention in one native call each. The norms and SiLU serve
steps of every size (threaded over rows), so a position's values never depend on how its
prompt was chunked.
"""

from __future__ import annotations

import ctypes

import torch

from tristream.engine.attention import AttnMetadata
from tristream.engine.config import ModelConfig
from tristream.engine.cpu.native import Kernels
from tristream.engine.kv_cache import KVCache
from tristream.engine.linear import Linear
from tristream.engine.models.llama import LlamaModel, TorchOps


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


class NativeOps:
    """`TorchOps` with the native kernels for steps of few rows (float32 models)."""

    def __init__(self, kernels: Kernels) -> None:
        self.lib = kernels.lib

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32:
            return TorchOps.rms_norm(x, w, eps)
        x = _f32(x)
        out = torch.empty_like(x)
        self.lib.ts_add_rms_norm(x.data_ptr(), None, x.shape[0], x.shape[1], w.data_ptr(), eps, out.data_ptr())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype != torch.float32:
            return TorchOps.add_rms_norm(x, residual, w, eps)
        r = x.clone() if not x.is_contiguous() or x.data_ptr() == residual.data_ptr() else x
        res = _f32(residual)
        out = torch.empty_like(r)
        self.lib.ts_add_rms_norm(r.data_ptr(), res.data_ptr(), r.shape[0], r.shape[1], w.data_ptr(), eps,
                                 out.data_ptr())
        return out, r

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        if gu.dtype != torch.float32:
            return TorchOps.silu_mul(gu)
        gu = _f32(gu)
        inter = gu.shape[1] // 2
        out = torch.empty(gu.shape[0], inter, dtype=torch.float32)
        self.lib.ts_silu_mul(gu.data_ptr(), gu.shape[0], inter, out.data_ptr())
        return out


def decode_indices(meta: AttnMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's int64 arrays for the kernels: positions, cache slots of the new tokens, and
    every row's context slots concatenated (row t's are kv_idx[kv_off[t]:kv_off[t + 1]])."""
    assert meta.slot_mapping is not None
    pos = meta.positions.to(torch.int64).contiguous()
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    idx, off = [], [0]
    for s in meta.seqs:
        kv = s.kv_index if s.kv_index is not None else slots[s.q_start:s.q_start + 1]
        idx.append(kv.to(torch.int64))
        off.append(off[-1] + kv.numel())
    return pos, slots, torch.cat(idx).contiguous(), torch.tensor(off, dtype=torch.int64)


class NativeDecodeAttention:
    """Attention backend for a decode step (one new token per sequence, float32 cache):
    rope, the cache write and attention over each sequence's cached context in one call."""

    def __init__(self, cfg: ModelConfig, cos_sin: torch.Tensor, meta: AttnMetadata, cache: KVCache,
                 kernels: Kernels) -> None:
        self.cfg, self.cache, self.lib = cfg, cache, kernels.lib
        self.cos_sin = cos_sin if cos_sin.dtype == torch.float32 else cos_sin.float()
        self.pos, self.slots, self.kv_idx, self.kv_off = decode_indices(meta)
        self.scale = cfg.head_dim ** -0.5

    @staticmethod
    def applies(meta: AttnMetadata, cache: KVCache | None) -> bool:
        return (cache is not None and meta.slot_mapping is not None and cache.k.dtype == torch.float32
                and all(s.q_len == 1 for s in meta.seqs))

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        qkv = _f32(qkv)
        t = qkv.shape[0]
        kc, vc = self.cache.flat(layer)
        out = torch.empty(t, cfg.q_size, dtype=torch.float32)
        self.lib.ts_attn_decode(qkv.data_ptr(), t, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                self.cos_sin.data_ptr(), self.pos.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                                self.slots.data_ptr(), self.kv_idx.data_ptr(), self.kv_off.data_ptr(),
                                self.scale, out.data_ptr())
        return out


class _QLin(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _QLin), ("o", _QLin), ("gate_up", _QLin), ("down", _QLin), ("post_norm", ctypes.c_void_p),
                ("next_norm", ctypes.c_void_p), ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p)]


class _Step(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int64), ("H", ctypes.c_int64), ("nh", ctypes.c_int64), ("nkv", ctypes.c_int64),
                ("hd", ctypes.c_int64), ("cos_sin", ctypes.c_void_p), ("pos", ctypes.c_void_p),
                ("slot", ctypes.c_void_p), ("kv_idx", ctypes.c_void_p), ("kv_off", ctypes.c_void_p),
                ("scale", ctypes.c_float), ("eps", ctypes.c_float)]


class NativeDecoder:
    """Every layer of a decode step in one native call (quantised float32 models on CPU).

    The layers' weight and cache addresses are gathered once; a step passes only its positions
    and cache slots. Python's share of a 30-layer step drops from ~1,300 torch ops to one call.
    """

    def __init__(self, model: LlamaModel, cache: KVCache, kernels: Kernels) -> None:
        self.model, self.cache, self.lib = model, cache, kernels.lib
        self.lib.ts_decode_layers.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_void_p]
        self.lib.ts_decode_layers.restype = ctypes.c_int
        self._keep: list[torch.Tensor] = []
        layers = model.layers
        arr = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            kc, vc = cache.flat(i)
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else model.norm
            arr[i] = _Layer(self._qlin(layer.qkv), self._qlin(layer.o), self._qlin(layer.gate_up),
                            self._qlin(layer.down), self._ptr(layer.post_norm), self._ptr(nxt),
                            kc.data_ptr(), vc.data_ptr())
        self.layers = arr
        self.cos_sin = model.cos_sin.float().contiguous()

    def _ptr(self, t: torch.Tensor) -> int:
        t = _f32(t.detach())
        self._keep.append(t)
        return t.data_ptr()

    def _qlin(self, lin: Linear) -> _QLin:
        t = lin.qtensors
        bias = self._ptr(lin.bias) if lin.bias is not None else None
        return _QLin(4 if lin.qformat == "q4" else 8, lin.out_features, lin.in_features, t["w"].data_ptr(),
                     t["d"].data_ptr(), t["m"].data_ptr() if "m" in t else None, bias)

    @staticmethod
    def applies(model: LlamaModel, cache: KVCache) -> bool:
        """Whether every layer projection is quantised and the cache holds float32."""
        return cache.k.dtype == torch.float32 and model.dtype == torch.float32 and all(
            lin.qformat in ("q4", "q8") for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))

    def forward(self, h: torch.Tensor, meta: AttnMetadata, ops: NativeOps) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of a decode step (embeddings `h` in)."""
        cfg = self.model.cfg
        pos, slots, kv_idx, kv_off = decode_indices(meta)
        h = _f32(h).clone()  # the residual stream, updated in place by the kernel
        x = ops.rms_norm(h, self.model.layers[0].input_norm, cfg.rms_norm_eps)
        step = _Step(h.shape[0], cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.cos_sin.data_ptr(),
                     pos.data_ptr(), slots.data_ptr(), kv_idx.data_ptr(), kv_off.data_ptr(), cfg.head_dim ** -0.5,
                     cfg.rms_norm_eps)
        rc = self.lib.ts_decode_layers(ctypes.addressof(self.layers), len(self.model.layers), ctypes.addressof(step),
                                       h.data_ptr(), x.data_ptr())
        if rc != 0:
            raise MemoryError("native decode step: out of memory for its scratch buffers")
        return x
