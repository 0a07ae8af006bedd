"""Launch planning for the paged-attention kernels, without Triton.

Everything here is plain Python over shapes and host ints: how many context splits a decode
launch gets (:func:`decode_num_partitions`), how tall a varlen tile is (:func:`prefill_block_m`),
and which steps launch every variant eager serving can need (:func:`warm_up_plan`). The
kernels (``draftwise.kernels.triton_decode`` and ``triton_prefill``) call these at launch; the
model runner calls :func:`warm_up_plan` at start-up. Importing this module imports neither
Triton nor the kernels (a test checks), so planning costs nothing where Triton is absent.
"""

from __future__ import annotations

import torch

__all__ = [
    "DEFAULT_SMS",
    "MAX_PARTITIONS",
    "MIN_DOT",
    "MIN_PARTITION_TOKENS",
    "decode_num_partitions",
    "next_power_of_2",
    "num_sms",
    "prefill_block_m",
    "warm_up_plan",
]

MIN_PARTITION_TOKENS = 256
"""A flash-decoding partition is never planned shorter than this many context tokens (shorter
ones cost more in the merge than they gain in parallelism)."""
MAX_PARTITIONS = 64
MIN_DOT = 16
"""``tl.dot`` wants every dimension >= 16 on NVIDIA GPUs; smaller tiles are padded and masked."""
DEFAULT_SMS = 128
"""Multiprocessors assumed off CUDA (the interpreter): a fixed stand-in, so that plans are
deterministic."""
_PROGRAMS_PER_SM = 4  # (sequence, KV head, partition) programs a decode launch aims for: a few waves


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``); ``triton.next_power_of_2``
    without Triton."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (:data:`DEFAULT_SMS` off CUDA)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def decode_num_partitions(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int = DEFAULT_SMS) -> int:
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


def prefill_block_m(max_query_len: int, group: int) -> int:
    """Rows per tile of the varlen kernel: enough for the longest run (a verify step needs
    few), at most 64 unless one group of query heads is larger."""
    block_m = min(64, max(MIN_DOT, next_power_of_2(max_query_len * group)))
    return max(block_m, next_power_of_2(group))


def warm_up_plan(
    *,
    max_num_seqs: int,
    max_num_tokens: int,
    max_context: int,
    block_size: int,
    num_kv_heads: int,
    group: int,
    num_sms: int = DEFAULT_SMS,
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
