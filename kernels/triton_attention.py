"""Triton paged attention over the block-paged KV cache: the CUDA twin of
``draftwise.kernels.reference.paged_attention``.

Two kernels read keys and values straight from the cache through each sequence's block
table (no gather into a dense copy first):

- **decode** (one new token per sequence), flash-decoding: each sequence's context is split
  into ``P`` partitions so that a small batch with long contexts still fills the GPU. Phase
  1 runs one program per (sequence, KV head, partition) and attends *all* query heads of
  that KV head at once (grouped-query attention: each key and value is loaded once per
  group); it leaves a running max, a sum of exponentials and an unnormalised output per
  partition. Phase 2 merges the partitions. ``P`` is chosen from the batch
  (:func:`decode_num_partitions`): enough programs to fill the device, so a large batch runs
  ``P = 1`` (no partial results, no merge) and a batch of one splits its context up to 64
  ways; never more splits than the longest context the block tables can hold has
  ``MIN_PARTITION_TOKENS``. Each sequence splits *its own* context evenly (partitions of
  ``ceil(seq_len / P)`` tokens, rounded up to a key tile) inside the kernel, so nothing is
  sized from ``max_model_len`` and no host read of ``seq_lens`` is needed: the call can be
  captured in a CUDA graph.
- **prefill / verify** (a varlen batch, 1 to N new tokens per sequence): one program per
  (sequence, KV head, tile of new tokens). A tile packs ``BLOCK_Q`` new tokens times the
  ``GROUP`` query heads of one KV head into the rows of one matrix, so a verify step's few
  tokens still make a tile worth a ``tl.dot`` and keys are again loaded once per group.
  Sequence ``i``'s new tokens are the last ``qlen_i`` positions of its ``seq_lens[i]``
  tokens of context; they attend causally among themselves and to all earlier context.

Both kernels take an optional sliding window (Mistral): a query at position ``p`` sees
keys at positions ``p - window < k <= p``. Scores, softmax and the output accumulator are
float32 whatever the input dtype (float32, float16, bfloat16); the output has ``q``'s dtype.

The module imports ``triton`` at import time (the kernels are defined at module level) but
touches no GPU: under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors, which is
how the CPU tests check them against the torch twin. The interpreter flag is read when the
kernels are defined, so it must be set before this module is first imported.
"""

# pyright: reportArgumentType=false, reportCallIssue=false, reportOperatorIssue=false
# (a @triton.jit function is typed by its Python signature: launches pass ints for constexpr
# parameters and launch options such as num_warps, and tl values are untyped)
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from draftwise.kernels.metadata import AttentionMetadata

__all__ = [
    "MIN_PARTITION_TOKENS",
    "decode_num_partitions",
    "num_sms",
    "recording_launches",
    "warm_up_plan",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
]

# A flash-decoding partition is never planned shorter than this many context tokens
# (shorter ones cost more in the merge than they gain in parallelism).
MIN_PARTITION_TOKENS = 256
MAX_PARTITIONS = 64
# (sequence, KV head, partition) programs a decode launch aims for: a few waves of the device
_PROGRAMS_PER_SM = 4
_DEFAULT_SMS = 128  # off CUDA (the interpreter): a fixed stand-in, so that plans are deterministic

_recording: set[tuple[object, ...]] | None = None


@contextlib.contextmanager
def recording_launches() -> Iterator[set[tuple[object, ...]]]:
    """Collect the compile key of every attention launch while the block runs: the kernel,
    its tensors' dtypes, its constexprs and the class Triton specialises each integer
    argument on (1, a multiple of 16, other). A key not seen before is a compilation on a
    GPU; the engine launches every key serving can need at start-up (:func:`warm_up_plan`),
    and tests check with this that serving launches none it did not. Off (no work per launch)
    unless a block records."""
    global _recording
    outer, _recording = _recording, set()
    try:
        yield _recording
    finally:
        _recording = outer


def _int_class(v: int) -> str:
    return "1" if v == 1 else "16" if v % 16 == 0 else "n"


def _note(
    kernel: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    ints: tuple[int, ...],
    constexprs: tuple[object, ...],
) -> None:
    """Record a launch's compile key when a :func:`recording_launches` block is open."""
    if _recording is None:
        return
    strides = (*q.stride()[:2], block_tables.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:2])
    classes = tuple(_int_class(i) for i in (*ints, *strides))
    _recording.add((kernel, (q.dtype, k_cache.dtype, out.dtype), classes, constexprs))


def prefill_block_m(max_query_len: int, group: int) -> int:
    """Rows per tile of the varlen kernel: enough for the longest run (a verify step needs
    few), at most 64 unless one group of query heads is larger."""
    block_m = min(64, max(_MIN_DOT, triton.next_power_of_2(max_query_len * group)))
    return max(block_m, triton.next_power_of_2(group))


def warm_up_plan(
    *,
    max_num_seqs: int,
    max_num_tokens: int,
    max_context: int,
    block_size: int,
    num_kv_heads: int,
    group: int,
    num_sms: int = _DEFAULT_SMS,
    min_width: int = 16,
) -> list[tuple[int, int, int]]:
    """Steps ``(sequences, tokens each, block-table width)`` that together launch every
    attention variant eager serving can: one decode step per number of partitions
    :func:`decode_num_partitions` can choose for up to ``max_num_seqs`` sequences over
    block tables of ``min_width`` to ``max_context`` tokens (widths are powers of two), and
    one varlen step per tile height :func:`prefill_block_m` can choose for runs of 2 to
    ``max_num_tokens`` tokens."""
    widths = []
    w = min_width
    while True:
        widths.append(w)
        if w * block_size >= max_context:
            break
        w *= 2
    steps: dict[tuple[str, int], tuple[int, int, int]] = {}
    for width in widths:
        for seqs in range(1, max_num_seqs + 1):
            p = decode_num_partitions(seqs, num_kv_heads, width * block_size, num_sms)
            steps.setdefault(("decode", p), (seqs, 1, width))
    n = 2
    while n <= max_num_tokens:
        steps.setdefault(("varlen", prefill_block_m(n, group)), (1, n, min_width))
        n *= 2
    return list(steps.values())


_LOG2E = 1.4426950408889634
# tl.dot wants every dimension >= 16 on NVIDIA GPUs; smaller tiles are padded and masked.
_MIN_DOT = 16


@triton.jit
def _attend_keys(
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
    m_i, l_i, acc = _attend_keys(
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
    m_i, l_i, acc = _attend_keys(
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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _dot_f32(dtype: torch.dtype) -> bool:
    """Whether the kernels multiply in float32 instead of ``dtype``: only for bfloat16 under
    the interpreter, whose ``tl.dot`` multiplies bfloat16's raw uint16 storage (Triton 3.9).
    Compiled kernels always multiply in the input dtype."""
    return dtype == torch.bfloat16 and _interpreting()


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 must stay float32 on tensor cores ("tf32" would lose ~3 decimal digits).
    return "ieee" if dtype == torch.float32 or _dot_f32(dtype) else "tf32"


def _check_block_n(block_n: int) -> int:
    # tl.arange needs a power of two; tl.dot on NVIDIA needs every dimension >= 16
    if block_n < _MIN_DOT or block_n & (block_n - 1):
        raise ValueError(f"block_n {block_n} must be a power of two >= {_MIN_DOT}")
    return block_n


def _check(
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


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (a fixed stand-in off CUDA)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


def decode_num_partitions(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int = _DEFAULT_SMS) -> int:
    """Context splits per sequence for a decode launch of ``num_seqs`` sequences whose block
    tables hold up to ``max_context`` tokens: a power of two, the largest that keeps the
    (sequence, KV head, partition) programs within a few waves of ``num_sms``
    multiprocessors, at most ``MAX_PARTITIONS`` and at most one per ``MIN_PARTITION_TOKENS``
    of ``max_context``; 1 (no merge) once the batch alone fills the device. Shapes only, no
    host read of lengths: a CUDA graph captures the value of its shape."""
    by_fill = _PROGRAMS_PER_SM * num_sms // max(1, num_seqs * num_kv_heads)
    by_len = max_context // MIN_PARTITION_TOKENS
    p = max(1, min(by_fill, by_len, MAX_PARTITIONS))
    return 1 << (p.bit_length() - 1)  # the largest power of two <= p


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
    q = _check(q, k_cache, v_cache, sliding_window, out)
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
    block_n = _check_block_n(block_n or 64)
    block_d = max(_MIN_DOT, triton.next_power_of_2(d))
    if num_partitions == 1:  # no partials to merge; phase 1 writes ``out``
        part_m = part_l = part_acc = out
    else:
        part_m = torch.empty(s, h, num_partitions, dtype=torch.float32, device=q.device)
        part_l = torch.empty(s, h, num_partitions, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(s, h, num_partitions, d, dtype=torch.float32, device=q.device)
    _note(
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
        scale * _LOG2E,
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
        BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        NUM_PARTITIONS=num_partitions,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(q.dtype),
        DOT_F32=_dot_f32(q.dtype),
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
            BLOCK_P=triton.next_power_of_2(num_partitions),
            BLOCK_N=block_n,
            NUM_PARTITIONS=num_partitions,
            num_warps=4 if num_partitions * d >= 4096 else 1,
        )
    return out


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
    q = _check(q, k_cache, v_cache, sliding_window, out)
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
    block_n = _check_block_n(block_n or 64)
    _note(
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
        scale * _LOG2E,
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
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(d)),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(q.dtype),
        DOT_F32=_dot_f32(q.dtype),
        num_warps=4,
    )
    return out


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
