"""Flash-decoding over the paged KV cache: one new token per sequence (docs/kernels.md,
"Decode partitions").

Each sequence's context is split into ``P`` partitions so that a small batch with long contexts
still fills the GPU. Phase 1 (:func:`_decode_partition_kernel`) runs one program per (sequence,
KV head, partition) and attends *all* query heads of that KV head at once (grouped-query
attention: each key and value is loaded once per group); it leaves a running max, a sum of
exponentials and an unnormalised output per partition. Phase 2 (:func:`_decode_reduce_kernel`)
merges the partitions. ``P`` is chosen from the batch
(``draftwise.kernels.launch_plan.decode_num_partitions``): a large batch runs ``P = 1`` (phase 1
writes the output, no merge). Each sequence splits *its own* context evenly (partitions of
``ceil(seq_len / P)`` tokens, rounded up to a key tile) inside the kernel, so nothing is sized
from ``max_model_len`` and no host read of ``seq_lens`` is needed: the call can be captured in a
CUDA graph.
"""

# pyright: reportArgumentType=false, reportCallIssue=false, reportOperatorIssue=false
# (a @triton.jit function is typed by its Python signature: launches pass ints for constexpr
# parameters and launch options such as num_warps, and tl values are untyped)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftwise.kernels.launch_plan import MIN_DOT, decode_num_partitions, next_power_of_2, num_sms
from draftwise.kernels.launch_record import note
from draftwise.kernels.triton_attend import LOG2E, attend_keys, check_block_n, check_inputs, dot_f32, dot_precision

__all__ = ["paged_decode_attention"]


@triton.jit
def _partition_tokens(seq_len, NUM_PARTITIONS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Context tokens per partition of a sequence of ``seq_len`` tokens: an even split into
    ``NUM_PARTITIONS``, rounded up to whole key tiles (at least one)."""
    per = (seq_len + NUM_PARTITIONS - 1) // NUM_PARTITIONS
    return tl.maximum((per + BLOCK_N - 1) // BLOCK_N, 1) * BLOCK_N


@triton.jit
def _decode_partition_kernel(
    q_ptr,  # [S, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    bt_ptr,  # [S, max_blocks] int32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # [S, H, D], written here only when NUM_PARTITIONS == 1
    part_m_ptr,  # [S, H, NUM_PARTITIONS] float32
    part_l_ptr,  # [S, H, NUM_PARTITIONS] float32
    part_acc_ptr,  # [S, H, NUM_PARTITIONS, D] float32
    qk_scale,
    window,
    num_heads,
    head_dim,
    stride_qs,
    stride_qh,
    stride_bts,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_os,
    stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_PARTITIONS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # multiply in float32 (the interpreter's bfloat16 tl.dot is wrong)
):
    """Phase 1 of flash-decoding: one (sequence, KV head, partition) of the sequence's own
    context split ``NUM_PARTITIONS`` ways."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g  # [BLOCK_G]
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0
    )  # [BLOCK_G, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)  # the new token is the last position
    size = _partition_tokens(seq_len, NUM_PARTITIONS, BLOCK_N)
    lo = part * size
    hi = tl.minimum(lo + size, seq_len)  # empty (hi <= lo) past the sequence's end
    if HAS_WINDOW:
        lo = tl.maximum(lo, seq_len - window)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = attend_keys(
        q,
        q_pos,
        m_i,
        l_i,
        acc,
        k_cache_ptr,
        v_cache_ptr,
        bt_ptr + seq.to(tl.int64) * stride_bts,
        kv_head,
        lo,
        hi,
        qk_scale,
        window,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        offs_d,
        d_mask,
        BLOCK_SIZE,
        BLOCK_N,
        HAS_WINDOW,
        DOT_PRECISION,
    )
    if NUM_PARTITIONS == 1:  # nothing to merge: normalise and write the output directly
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        row = (seq.to(tl.int64) * num_heads + heads) * NUM_PARTITIONS + part  # [BLOCK_G]
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * head_dim + offs_d[None, :], acc, mask=q_mask)


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr,  # [S, H, NUM_PARTITIONS] float32
    part_l_ptr,  # [S, H, NUM_PARTITIONS] float32
    part_acc_ptr,  # [S, H, NUM_PARTITIONS, D] float32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # [S, H, D]
    num_heads,
    head_dim,
    stride_os,
    stride_oh,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,  # NUM_PARTITIONS padded to a power of two
    BLOCK_N: tl.constexpr,  # phase 1's key tile (partitions are whole tiles)
    NUM_PARTITIONS: tl.constexpr,
):
    """Phase 2 of flash-decoding: merge one (sequence, query head)'s partitions."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_p = tl.arange(0, BLOCK_P)
    # only partitions that hold part of the context; the rest did no work
    p_mask = (offs_p < NUM_PARTITIONS) & (offs_p * _partition_tokens(seq_len, NUM_PARTITIONS, BLOCK_N) < seq_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    row = (seq.to(tl.int64) * num_heads + head) * NUM_PARTITIONS + offs_p  # [BLOCK_P]
    m = tl.load(part_m_ptr + row, mask=p_mask, other=float("-inf"))  # [BLOCK_P]
    s_exp = tl.load(part_l_ptr + row, mask=p_mask, other=0.0)  # [BLOCK_P]
    m_max = tl.max(m, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_use)  # [BLOCK_P]; 0 for partitions with no visible key
    l_sum = tl.sum(w * s_exp, 0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * head_dim + offs_d[None, :], mask=p_mask[:, None] & d_mask[None, :], other=0.0
    )  # [BLOCK_P, BLOCK_D]
    o = tl.sum(acc * w[:, None], 0) / tl.where(l_sum > 0.0, l_sum, 1.0)  # [BLOCK_D]
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask
    )


def paged_decode_attention(
    q: torch.Tensor,  # [S, H, D] one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, context length including the new token
    scale: float,
    sliding_window: int | None = None,
    *,
    num_partitions: int | None = None,  # context splits per sequence; None: decode_num_partitions
    out: torch.Tensor | None = None,  # [S, H, D] written in place when given (static buffer)
    block_n: int | None = None,  # keys per inner iteration (tests shrink it); default 64
) -> torch.Tensor:  # [S, H, D]
    """Flash-decoding attention of each sequence's one new token over its cached context.

    The new tokens' KV must already be in the cache. No host read of device tensors: the
    launch depends only on shapes, so it can be captured in a CUDA graph. A sequence with
    ``seq_lens == 0`` (a padded graph slot) gets zeros.
    """
    q = check_inputs(q, k_cache, v_cache, sliding_window, out)
    s, h, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if block_tables.shape[0] != s or seq_lens.shape[0] != s:
        raise ValueError("decode attention takes one query token per sequence")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if s == 0:
        return out
    group = h // hkv
    if num_partitions is None:
        num_partitions = decode_num_partitions(s, hkv, block_tables.shape[1] * block_size, num_sms(q.device))
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    block_n = check_block_n(block_n or 64)
    block_d = max(MIN_DOT, next_power_of_2(d))
    if num_partitions == 1:  # no partials to merge; phase 1 writes ``out``
        part_m = part_l = part_acc = out
    else:
        part_m = torch.empty(s, h, num_partitions, dtype=torch.float32, device=q.device)
        part_l = torch.empty(s, h, num_partitions, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(s, h, num_partitions, d, dtype=torch.float32, device=q.device)
    note(
        "decode",
        q,
        k_cache,
        v_cache,
        block_tables,
        out,
        (sliding_window or 0, h, d),
        (group, block_d, block_n, block_size, num_partitions, sliding_window is not None),
    )
    _decode_partition_kernel[(s, hkv, num_partitions)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_m,
        part_l,
        part_acc,
        scale * LOG2E,
        sliding_window or 0,
        h,
        d,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_G=max(MIN_DOT, next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        NUM_PARTITIONS=num_partitions,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        DOT_F32=dot_f32(q.dtype),
        num_warps=4,
    )
    if num_partitions > 1:
        _decode_reduce_kernel[(s, h)](
            part_m,
            part_l,
            part_acc,
            seq_lens,
            out,
            h,
            d,
            out.stride(0),
            out.stride(1),
            BLOCK_D=block_d,
            BLOCK_P=next_power_of_2(num_partitions),
            BLOCK_N=block_n,
            NUM_PARTITIONS=num_partitions,
            num_warps=4 if num_partitions * d >= 4096 else 1,
        )
    return out
