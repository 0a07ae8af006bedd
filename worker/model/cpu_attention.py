"""Paged attention and KV-cache writes on CPU from this package's kernel library (``cpu_attention.cpp``,
built with ``cpu_matmul``), registered as the ``paged_attention`` and ``write_kv_cache`` ops for CPU.

The torch twins (``draftwise.kernels.reference``) gather each batch's blocks into padded tensors and
run torch's attention on them: per layer a dozen ops and their Python overhead, and a copy of every
context. Here one call per layer attends every sequence's new tokens where its blocks lie, and one
call writes the new KV rows. Sequences with a long prompt chunk (more than
``reference.SHORT_QUERY_MAX`` new tokens) stay with torch's attention, whose blocked kernel wins on
long query runs. Anything the kernel does not take (no kernel, another dtype or device, gradients,
head sizes not a multiple of 8, more than ``dw_attention_max_group()`` query heads per KV head) goes
to the twin, with the same results up to float32 rounding: the softmax's exponentials come from a
polynomial good to a few ulp and sums run in another order (tests/model/test_cpu_attention.py).
"""

from __future__ import annotations

import torch

from draftwise.kernels import AttentionMetadata, reference
from draftwise.worker.model import cpu_matmul

BACKEND = "draftwise-cpu"  # the name both ops are registered under (llama.py), and their backend_state entry
STATE = BACKEND


def _takes(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad for t in ts)


def write_kv_cache(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1: padding, written nowhere
    has_padding: bool = False,
) -> None:
    """``reference.write_kv_cache`` with one call: rows copied, bit for bit."""
    lib = cpu_matmul.kernel()
    t, h, d = k.shape
    if (
        lib is None
        or not _takes(k, v, k_cache, v_cache)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
        or slot_mapping.numel() != t
        or any(x.stride(2) != 1 or x.stride(1) != d for x in (k, v))
        or tuple(v.shape) != (t, h, d)
        or tuple(k_cache.shape[-2:]) != (h, d)
    ):
        reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, has_padding)
        return
    slots = k_cache.shape[0] * k_cache.shape[1]
    bad = lib.dw_write_kv_f32(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr(), t, h * d,
        k_cache.data_ptr(), v_cache.data_ptr(), slots,
    )  # fmt: skip
    if bad >= 0:  # nothing written (the twin's index_copy_ raises too)
        raise IndexError(f"write_kv_cache: slot {bad} is beyond the cache's {slots}")


def _plan(meta: AttentionMetadata) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the sequences the kernel attends, int32; those left to torch; query_start_loc, seq_lens and block
    tables as contiguous int32), once per forward pass."""
    plan = meta.backend_state.get(STATE)
    if plan is None:
        short = [i for i, n in enumerate(meta.query_lens_cpu) if n <= reference.SHORT_QUERY_MAX]
        long = [i for i, n in enumerate(meta.query_lens_cpu) if n > reference.SHORT_QUERY_MAX]
        int32 = torch.int32
        plan = (
            torch.tensor(short, dtype=int32),
            long,
            meta.query_start_loc.to(int32).contiguous(),
            meta.seq_lens.to(int32).contiguous(),
            meta.block_tables.to(int32).contiguous(),
        )
        meta.backend_state[STATE] = plan
    return plan


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """``reference.paged_attention`` (causal, over each sequence's paged context, its new KV written)."""
    lib = cpu_matmul.kernel()
    t, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    if (
        lib is None
        or not _takes(q, k_cache, v_cache)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or q.stride(2) != 1
        or q.stride(1) != d
        or d % 8
        or k_cache.shape[3] != d
        or heads % kv_heads
        or heads // kv_heads > lib.dw_attention_max_group()
        or meta.slot_mapping.device.type != "cpu"
    ):
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window)
    short, long, qsl, seq_lens, tables = _plan(meta)
    out = torch.empty(t, heads, d, dtype=torch.float32)
    if short.numel():
        lib.dw_paged_attention_f32(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), meta.block_size, heads, kv_heads, d,
            qsl.data_ptr(), seq_lens.data_ptr(), tables.data_ptr(), tables.shape[1], short.data_ptr(), short.numel(),
            scale, sliding_window or 0, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    if long:
        reference.paged_attention_of(q, k_cache, v_cache, meta, scale, sliding_window, out, long)
    return out
