"""The paged KV cache: per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]`` for
keys and for values, allocated once."""

from __future__ import annotations

import torch

from draftwise.worker.model.model_config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class KVCache:
    """Keys and values of every layer for ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, blocks, block_size, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.k[i], self.v[i]) for i in range(cfg.num_hidden_layers)]

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
