"""Paged KV-cache storage: fixed-size blocks of slots per layer, addressed by block tables."""

from __future__ import annotations

import torch

from tristream.engine.config import ModelConfig


class KVCache:
    """Keys and values for every layer: [layers, num_blocks, block_size, kv_heads, head_dim].

    Slot s of a sequence lives at block `block_table[s // block_size]`, offset
    `s % block_size`; the flat slot id is `block * block_size + offset`. Block ownership is
    the `BlockManager`'s business; this class only holds the memory.
    """

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._flat_k = self.k.view(cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self._flat_v = self.v.view(cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [num_slots, kv_heads, head_dim] of one layer's keys and values."""
        return self._flat_k[layer], self._flat_v[layer]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elt = torch.empty(0, dtype=dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.kv_size * elt
