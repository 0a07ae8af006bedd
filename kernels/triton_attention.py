"""Triton paged attention over the block-paged KV cache: the CUDA twin of
``draftwise.kernels.reference.paged_attention``, and the one entry point the dispatch point
registers (:func:`paged_attention`).

Two kernels read keys and values straight from the cache through each sequence's block
table (no gather into a dense copy first):

- **decode** (one new token per sequence), flash-decoding with the context split into ``P``
  partitions chosen from the batch: ``draftwise.kernels.triton_decode``;
- **prefill / verify** (a varlen batch, 1 to N new tokens per sequence), tiles of new tokens
  times the query heads of one KV head: ``draftwise.kernels.triton_prefill``.

Both share the online-softmax loop over keys and their input checks
(``draftwise.kernels.triton_attend``), and both take an optional sliding window (Mistral): a
query at position ``p`` sees keys at positions ``p - window < k <= p``. Scores, softmax and the
output accumulator are float32 whatever the input dtype (float32, float16, bfloat16); the
output has ``q``'s dtype. Their launch parameters (partitions, tile heights, the start-up
warm-up plan) are planned without Triton in ``draftwise.kernels.launch_plan``; the launch
recorder tests use is ``draftwise.kernels.launch_record``.

These modules import ``triton`` at import time (the kernels are defined at module level) but
touch no GPU: under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors, which is how
the CPU tests check them against the torch twin. The interpreter flag is read when the kernels
are defined, so it must be set before they are first imported.
"""

from __future__ import annotations

import torch

from draftwise.kernels.metadata import AttentionMetadata
from draftwise.kernels.triton_decode import paged_decode_attention
from draftwise.kernels.triton_prefill import paged_prefill_attention

__all__ = ["paged_attention", "paged_decode_attention", "paged_prefill_attention"]


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Drop-in for ``draftwise.kernels.reference.paged_attention``: causal attention of each
    sequence's new tokens over its whole context, read from the paged cache (the new
    tokens' KV must already be written). Flash-decoding when every sequence brings one
    token, the varlen prefill/verify kernel otherwise. No host-device sync."""
    if meta.block_size != k_cache.shape[1]:
        raise ValueError(f"metadata block size {meta.block_size} != cache block size {k_cache.shape[1]}")
    if meta.max_query_len == 1:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window)
    return paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        scale,
        sliding_window,
    )
