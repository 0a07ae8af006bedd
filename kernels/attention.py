"""The attention-backend interface the model code calls, one object per model runtime.

A backend is chosen once from the device (``get_attention_backend``) and resolves its ops
through the dispatch point, so the model never branches on devices itself.
"""

from __future__ import annotations

import torch

from draftwise.kernels import dispatch
from draftwise.kernels.metadata import AttentionMetadata


class AttentionBackend:
    """Writes new KV into the paged cache and attends over it."""

    def __init__(self, device: torch.device | str, prefer_reference: bool = False) -> None:
        self.device = torch.device(device)
        self.name = dispatch.backend_name("paged_attention", self.device, prefer_reference)
        self._write = dispatch.impl("write_kv_cache", self.device, prefer_reference)
        self._attend = dispatch.impl("paged_attention", self.device, prefer_reference)

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        self._write(k, v, k_cache, v_cache, meta.slot_mapping, meta.has_padding)
        return self._attend(q, k_cache, v_cache, meta, scale, sliding_window)


def get_attention_backend(device: torch.device | str, prefer_reference: bool = False) -> AttentionBackend:
    """The attention backend for ``device``: Triton on CUDA once registered, the torch twin elsewhere."""
    return AttentionBackend(device, prefer_reference)
