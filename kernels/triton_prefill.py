"""Varlen causal attention over the paged KV cache: prompt chunks, verify runs and single
decode tokens in one flat batch.

One program per (sequence, KV head, tile of new tokens). A tile packs ``BLOCK_Q`` new tokens
times the ``GROUP`` query heads of one KV head into the rows of one matrix, so a verify step's
few tokens still make a tile worth a ``tl.dot`` and keys are loaded once per group. Sequence
``i``'s new tokens are the last ``qlen_i`` positions of its ``seq_lens[i]`` tokens of context;
they attend causally among themselves and to all earlier context. The tile height comes from
``draftwise.kernels.launch_plan.prefill_block_m``.
"""

# pyright: reportArgumentType=false, reportCallIssue=false, reportOperatorIssue=false
# (a @triton.jit function is typed by its Python signature: launches pass ints for constexpr
# parameters and launch options such as num_warps, and tl values are untyped)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftwise.kernels.launch_plan import MIN_DOT, next_power_of_2, prefill_block_m
from draftwise.kernels.launch_record import note
from draftwise.kernels.triton_attend import LOG2E, attend_keys, check_block_n, check_inputs, dot_f32, dot_precision

__all__ = ["paged_prefill_attention"]


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    bt_ptr,  # [S, max_blocks] int32
    query_start_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # [T, H, D]
    qk_scale,
    window,
    head_dim,
    stride_qt,
    stride_qh,
    stride_bts,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # rows per tile: BLOCK_Q new tokens x GROUP heads (padded)
    BLOCK_Q: tl.constexpr,  # new tokens per tile (BLOCK_M // GROUP)
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # multiply in float32 (the interpreter's bfloat16 tl.dot is wrong)
):
    """One (sequence, KV head, tile of BLOCK_Q new tokens) of a varlen batch."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # position of the sequence's first new token
    offs_m = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] index among the sequence's new tokens
    heads = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_ok = (offs_m < BLOCK_Q * GROUP) & (qi < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    io_mask = row_ok[:, None] & d_mask[None, :]
    tok = (q_start + qi).to(tl.int64)  # [BLOCK_M] row in the flat batch
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0
    )  # [BLOCK_M, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = first_pos + qi  # [BLOCK_M]
    n_rows = tl.minimum(q_len - tile * BLOCK_Q, BLOCK_Q)  # new tokens in this tile (<= 0: none)
    tile_first = first_pos + tile * BLOCK_Q
    hi = tl.where(n_rows > 0, tile_first + n_rows, 0)  # keys up to the tile's last query
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(tile_first - window + 1, 0)  # the tile's first query sees no earlier key
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
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
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D] new tokens of all sequences, concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, context length including the new tokens
    query_start_loc: torch.Tensor,  # [S + 1] int32, start of each sequence's tokens in q
    max_query_len: int,  # host int: longest run of new tokens (sizes the grid only)
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,  # [T, H, D] written in place when given (static buffer)
    block_m: int | None = None,  # rows per tile (new tokens x group heads); power of two >= group
    block_n: int | None = None,  # keys per inner iteration
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of a varlen batch's new tokens (prompt chunks, verify runs, single
    decode tokens) over their cached context, read through the block tables.

    The new tokens' KV must already be in the cache. ``max_query_len`` is a host int that
    only sizes the grid (a CUDA graph captures it with its bucket); tiles past a sequence's
    own tokens do nothing. Padded sequences with no new tokens are harmless.
    """
    q = check_inputs(q, k_cache, v_cache, sliding_window, out)
    t, h, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    s = seq_lens.shape[0]
    if block_tables.shape[0] != s or query_start_loc.shape[0] != s + 1:
        raise ValueError("block_tables, seq_lens and query_start_loc must have one entry per sequence")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t == 0 or s == 0 or max_query_len < 1:
        return out
    group = h // hkv
    if block_m is None:
        block_m = prefill_block_m(max_query_len, group)
    if block_m < group or block_m & (block_m - 1):
        raise ValueError(f"block_m {block_m} must be a power of two >= the group size {group}")
    block_q = block_m // group
    block_n = check_block_n(block_n or 64)
    note(
        "varlen",
        q,
        k_cache,
        v_cache,
        block_tables,
        out,
        (sliding_window or 0, d),
        (group, block_m, block_n, block_size, sliding_window is not None),
    )
    _prefill_kernel[(s, hkv, triton.cdiv(max_query_len, block_q))](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2E,
        sliding_window or 0,
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
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_D=max(MIN_DOT, next_power_of_2(d)),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        DOT_F32=dot_f32(q.dtype),
        num_warps=4,
    )
    return out
