"""What both paged-attention kernels share: the online-softmax loop over keys read through a
block table (:func:`attend_keys`, a ``@triton.jit`` helper the kernels inline), the input
checks of their wrappers, and the choice of ``tl.dot`` precision.

Imports ``triton`` at import time; touches no GPU (see ``draftwise.kernels.triton_attention``).
"""

# pyright: reportArgumentType=false, reportCallIssue=false, reportOperatorIssue=false
# (a @triton.jit function is typed by its Python signature: launches pass ints for constexpr
# parameters and launch options such as num_warps, and tl values are untyped)
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from draftwise.kernels.launch_plan import MIN_DOT

__all__ = ["LOG2E", "attend_keys", "check_block_n", "check_inputs", "dot_f32", "dot_precision", "interpreting"]

LOG2E = 1.4426950408889634


@triton.jit
def attend_keys(
    q,  # [BLOCK_M, BLOCK_D] query rows, input dtype
    q_pos,  # [BLOCK_M] int32 absolute position of each row's query token
    m_i,  # [BLOCK_M] float32 running max of the scores (log2 domain)
    l_i,  # [BLOCK_M] float32 running sum of exp2(score - m_i)
    acc,  # [BLOCK_M, BLOCK_D] float32 running unnormalised output
    k_cache_ptr,
    v_cache_ptr,
    bt_row_ptr,  # this sequence's row of the block table
    kv_head,
    lo,  # first key position to visit
    hi,  # one past the last key position to visit
    qk_scale,  # softmax scale * log2(e)
    window,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    offs_d,  # [BLOCK_D]
    d_mask,  # [BLOCK_D]
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    BLOCK_N: tl.constexpr,  # keys per iteration
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax attention of ``q``'s rows over the keys at positions ``[lo, hi)``,
    read through the block table; causal (and windowed) per row. Returns ``(m, l, acc)``."""
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        tok_ok = tok < hi
        blk = tl.load(bt_row_ptr + tok // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)  # [BLOCK_N]
        slot = tok % BLOCK_SIZE
        k_off = blk * stride_kb + slot * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        kv_mask = tok_ok[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        ok = tok_ok[None, :] & (tok[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            ok = ok & (tok[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # A row with no visible key yet keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_use)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = blk * stride_vb + slot * stride_vs + kv_head * stride_vh  # [BLOCK_N]
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_f32(dtype: torch.dtype) -> bool:
    """Whether the kernels multiply in float32 instead of ``dtype``: only for bfloat16 under
    the interpreter, whose ``tl.dot`` multiplies bfloat16's raw uint16 storage (Triton 3.9).
    Compiled kernels always multiply in the input dtype."""
    return dtype == torch.bfloat16 and interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    # float32 must stay float32 on tensor cores ("tf32" would lose ~3 decimal digits).
    return "ieee" if dtype == torch.float32 or dot_f32(dtype) else "tf32"


def check_block_n(block_n: int) -> int:
    # tl.arange needs a power of two; tl.dot on NVIDIA needs every dimension >= 16
    if block_n < MIN_DOT or block_n & (block_n - 1):
        raise ValueError(f"block_n {block_n} must be a power of two >= {MIN_DOT}")
    return block_n


def check_inputs(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    sliding_window: int | None,
    out: torch.Tensor | None,  # [T, H, D]
) -> torch.Tensor:
    """Validate shapes and return ``q`` with a unit stride on its last dimension."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"expected q [T, H, D] and caches [blocks, block_size, Hkv, D]; got {q.shape}, {k_cache.shape}"
        )
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}")
    h, d = q.shape[1:]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d or h % hkv:
        raise ValueError(f"{h} query heads of dim {d} do not fit {hkv} KV heads of dim {k_cache.shape[3]}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dimension")
    return q if q.stride(2) == 1 else q.contiguous()
