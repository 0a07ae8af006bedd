"""The Triton paged-attention kernels, run in Triton's interpreter on CPU (tests/conftest.py
sets TRITON_INTERPRET=1), against a dense causal softmax computed here in float64 and
against the torch twin ``draftwise.kernels.reference.paged_attention``.

Caches are filled with random values everywhere (unused blocks included) and block tables
are shuffled, so a read through the wrong block or slot shows up. Output buffers are
poisoned with NaN before each run, so a row the kernel forgets to write fails.
Shapes stay small: the interpreter runs every program in Python.
"""

from __future__ import annotations

import random

import pytest
import torch

from draftwise.kernels import AttentionMetadata, reference
from draftwise.kernels import launch_plan as plan
from draftwise.kernels import triton_attention as ta

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _cache(
    seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Random caches ([num_blocks, block_size, Hkv, D] each) and shuffled block tables covering ``seq_lens``."""
    rng = random.Random(seed)
    need = [-(-s // block_size) for s in seq_lens]
    pool = list(range(sum(need) + 3))  # a few blocks nobody owns
    rng.shuffle(pool)
    tables, i = [], 0
    for n in need:
        tables.append(pool[i : i + n])
        i += n
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(len(pool), block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(len(pool), block_size, kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, tables


def _dense(
    q: torch.Tensor,  # [n, H, D] new tokens of one sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: list[int],
    seq_len: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [n, H, D] float64
    """Plain causal softmax attention in float64 over the context gathered through ``table``."""
    h, d = k_cache.shape[2:]
    k = k_cache[torch.tensor(table, dtype=torch.long)].reshape(-1, h, d)[:seq_len].double()  # [L, Hkv, D]
    v = v_cache[torch.tensor(table, dtype=torch.long)].reshape(-1, h, d)[:seq_len].double()
    rep = q.shape[1] // h
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [L, H, D]
    q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]  # [n, 1]
    kp = torch.arange(seq_len)[None, :]  # [1, L]
    mask = kp <= q_pos
    if window is not None:
        mask &= kp > q_pos - window
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def _check_all(
    out: torch.Tensor,  # [T, H, D]
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: list[list[int]],
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    window: int | None,
) -> None:
    """Every sequence's rows against the dense float64 softmax and the torch twin."""
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = TOL[q.dtype]
    row = 0
    for n, s, table in zip(query_lens, seq_lens, tables, strict=True):
        want = _dense(q[row : row + n], k_cache, v_cache, table, s, scale, window)
        torch.testing.assert_close(out[row : row + n].double(), want, **tol, msg=lambda m, s=s, n=n: f"{s=} {n=}: {m}")
        row += n
    meta = AttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=k_cache.shape[1]
    )
    twin = reference.paged_attention(q, k_cache, v_cache, meta, scale, window)
    torch.testing.assert_close(out.float(), twin.float(), **tol)


def _boundary_lens(block_size: int, partition: int) -> list[int]:
    """Context lengths at and around block and partition boundaries, and several partitions."""
    return [1, block_size - 1, block_size, block_size + 1, partition - 1, partition + 1, 3 * partition + 5]


def _meta_tensors(
    tables: list[list[int]], seq_lens: list[int], query_lens: list[int], block_size: int
) -> AttentionMetadata:
    return AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=block_size)


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, float("nan"), dtype=like.dtype)


# ---------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (4, 1)])
def test_decode_crosses_block_and_partition_boundaries(block_size, heads, kv_heads):
    """Four partitions of each sequence's own context, in tiles of 16 keys: the short
    sequences fill one or two of them (the rest are empty), the longest all four."""
    d, partition = 16, 2 * block_size
    seq_lens = _boundary_lens(block_size, partition)
    k_cache, v_cache, tables = _cache(seq_lens, block_size, kv_heads, d, torch.float32, seed=block_size + heads)
    meta = _meta_tensors(tables, seq_lens, [1] * len(seq_lens), block_size)
    q = torch.randn(len(seq_lens), heads, d)
    out = ta.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        d**-0.5,
        num_partitions=4,
        block_n=16,
        out=_poisoned(q),
    )
    _check_all(out, q, k_cache, v_cache, tables, [1] * len(seq_lens), seq_lens, d**-0.5, None)


def test_decode_several_key_tiles_per_partition():
    """``block_n`` smaller than the partition: the online softmax runs over several tiles."""
    d, block_size = 16, 16
    seq_lens = [5, 17, 63, 64, 65, 150, 200]
    k_cache, v_cache, tables = _cache(seq_lens, block_size, 2, d, torch.float32, seed=3)
    meta = _meta_tensors(tables, seq_lens, [1] * len(seq_lens), block_size)
    q = torch.randn(len(seq_lens), 8, d) * 2  # sharper softmax: rescaling mistakes show
    out = ta.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        d**-0.5,
        num_partitions=2,  # 200 tokens: two partitions of 112 keys, seven tiles each
        block_n=16,
        out=_poisoned(q),
    )
    _check_all(out, q, k_cache, v_cache, tables, [1] * len(seq_lens), seq_lens, d**-0.5, None)


def test_decode_single_partition_writes_output_directly():
    """Tables too short for a second partition: one partition, no merge kernel."""
    d, block_size = 16, 16
    seq_lens = [1, 15, 16, 17, 40]
    k_cache, v_cache, tables = _cache(seq_lens, block_size, 2, d, torch.float32, seed=4)
    meta = _meta_tensors(tables, seq_lens, [1] * len(seq_lens), block_size)
    assert plan.decode_num_partitions(len(seq_lens), 2, meta.block_tables.shape[1] * block_size) == 1
    q = torch.randn(len(seq_lens), 4, d)
    out = ta.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.3, out=_poisoned(q))
    _check_all(out, q, k_cache, v_cache, tables, [1] * len(seq_lens), seq_lens, 0.3, None)


@pytest.mark.parametrize("partitions", [1, 4])
def test_decode_padded_slots_are_harmless(partitions):
    """A CUDA-graph batch padded to its bucket: extra rows with seq_len 0 and an all-zero
    block table row get zeros, and the real rows are unaffected."""
    d, block_size = 16, 16
    seq_lens = [33, 70]
    k_cache, v_cache, tables = _cache(seq_lens, block_size, 2, d, torch.float32, seed=5)
    meta = _meta_tensors(tables, seq_lens, [1, 1], block_size)
    bt = torch.cat([meta.block_tables, torch.zeros(2, meta.block_tables.shape[1], dtype=torch.int32)])
    lens = torch.cat([meta.seq_lens, torch.zeros(2, dtype=torch.int32)])
    q = torch.randn(4, 8, d)
    out = ta.paged_decode_attention(
        q, k_cache, v_cache, bt, lens, d**-0.5, num_partitions=partitions, block_n=16, out=_poisoned(q)
    )
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    _check_all(out[:2], q[:2], k_cache, v_cache, tables, [1, 1], seq_lens, d**-0.5, None)


def test_decode_odd_head_dim_and_strided_query():
    """head_dim 24 (padded to a 32-wide tile) and ``q`` a view into a fused q/k projection."""
    d, block_size, heads, kv_heads = 24, 16, 6, 3
    seq_lens = [7, 31, 33, 90]
    k_cache, v_cache, tables = _cache(seq_lens, block_size, kv_heads, d, torch.float32, seed=6)
    meta = _meta_tensors(tables, seq_lens, [1] * len(seq_lens), block_size)
    qk = torch.randn(len(seq_lens), heads + kv_heads, d)
    q = qk[:, :heads]  # [S, H, D], not contiguous
    assert not q.is_contiguous()
    out = ta.paged_decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, d**-0.5, num_partitions=4, block_n=16, out=_poisoned(q)
    )
    _check_all(out, q, k_cache, v_cache, tables, [1] * len(seq_lens), seq_lens, d**-0.5, None)


def test_decode_same_output_whatever_the_split():
    """The split is a schedule, not a different computation: 1, 2, 8 and 64 partitions of
    the same contexts agree (to float32 rounding), wide tables or narrow."""
    d, block_size = 16, 16
    seq_lens = [1, 70, 255, 600]
    k_cache, v_cache, tables = _cache(seq_lens, block_size, 2, d, torch.float32, seed=8)
    meta = _meta_tensors(tables, seq_lens, [1] * len(seq_lens), block_size)
    wide = torch.zeros(len(seq_lens), 256, dtype=torch.int32)  # a graph's static tables: room for 4096 tokens
    wide[:, : meta.block_tables.shape[1]] = meta.block_tables
    q = torch.randn(len(seq_lens), 4, d)
    outs = [
        ta.paged_decode_attention(q, k_cache, v_cache, bt, meta.seq_lens, d**-0.5, num_partitions=p, out=_poisoned(q))
        for p in (1, 2, 8, 64)
        for bt in (meta.block_tables, wide)
    ]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-6, rtol=1e-5)
    _check_all(outs[0], q, k_cache, v_cache, tables, [1] * len(seq_lens), seq_lens, d**-0.5, None)


# ------------------------------------------------------------------------------- prefill / verify


# (earlier context, new tokens): decode tokens, verify runs of 1 + k at the end of long
# contexts, a first prompt chunk and prompt chunks in the middle of a context
PREFILL_SHAPES = [(0, 1), (40, 1), (70, 9), (100, 5), (63, 2), (0, 20), (45, 30)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (4, 1)])
def test_prefill_and_verify_varlen_batch(block_size, heads, kv_heads):
    d = 16
    query_lens = [n for _, n in PREFILL_SHAPES]
    seq_lens = [c + n for c, n in PREFILL_SHAPES]
    k_cache, v_cache, tables = _cache(seq_lens, block_size, kv_heads, d, torch.float32, seed=10 + block_size + heads)
    meta = _meta_tensors(tables, seq_lens, query_lens, block_size)
    q = torch.randn(meta.num_tokens, heads, d)
    out = ta.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        d**-0.5,
        out=_poisoned(q),
    )
    _check_all(out, q, k_cache, v_cache, tables, query_lens, seq_lens, d**-0.5, None)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 32)])
def test_prefill_small_tiles(block_m, block_n):
    """Many query tiles per sequence and several key tiles per query tile."""
    d, block_size, heads, kv_heads = 16, 16, 8, 2
    query_lens = [n for _, n in PREFILL_SHAPES]
    seq_lens = [c + n for c, n in PREFILL_SHAPES]
    k_cache, v_cache, tables = _cache(seq_lens, block_size, kv_heads, d, torch.float32, seed=20 + block_m)
    meta = _meta_tensors(tables, seq_lens, query_lens, block_size)
    q = torch.randn(meta.num_tokens, heads, d) * 2
    out = ta.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        d**-0.5,
        out=_poisoned(q),
        block_m=block_m,
        block_n=block_n,
    )
    _check_all(out, q, k_cache, v_cache, tables, query_lens, seq_lens, d**-0.5, None)


def test_prefill_kernel_runs_a_decode_batch():
    d, block_size = 16, 32
    seq_lens = _boundary_lens(block_size, 64)
    k_cache, v_cache, tables = _cache(seq_lens, block_size, 2, d, torch.float32, seed=30)
    meta = _meta_tensors(tables, seq_lens, [1] * len(seq_lens), block_size)
    q = torch.randn(len(seq_lens), 8, d)
    out = ta.paged_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 1, d**-0.5, out=_poisoned(q)
    )
    _check_all(out, q, k_cache, v_cache, tables, [1] * len(seq_lens), seq_lens, d**-0.5, None)


def test_prefill_padded_sequences_are_harmless():
    """Sequences with no new tokens (a padded verify batch) write nothing and disturb nothing."""
    d, block_size = 16, 16
    k_cache, v_cache, tables = _cache([40, 20], block_size, 2, d, torch.float32, seed=31)
    meta = _meta_tensors(tables, [40, 20], [4, 4], block_size)
    bt = torch.cat([meta.block_tables, torch.zeros(1, meta.block_tables.shape[1], dtype=torch.int32)])
    lens = torch.cat([meta.seq_lens, torch.zeros(1, dtype=torch.int32)])
    qsl = torch.cat([meta.query_start_loc, meta.query_start_loc[-1:]])  # the padded sequence brings 0 tokens
    q = torch.randn(9, 8, d)  # one spare row past every sequence's tokens
    out = ta.paged_prefill_attention(q, k_cache, v_cache, bt, lens, qsl, 4, d**-0.5, out=_poisoned(q))
    assert torch.isnan(out[8]).all()  # nobody's token: left alone
    _check_all(out[:8], q[:8], k_cache, v_cache, tables, [4, 4], [40, 20], d**-0.5, None)


# ------------------------------------------------------------------------------ sliding window


@pytest.mark.parametrize("window", [1, 5, 40])
def test_sliding_window_both_kernels(window):
    d, block_size, heads, kv_heads = 16, 16, 8, 2
    # decode: windows inside one block, across blocks and across partitions
    seq_lens = [1, 4, 17, 50, 100]
    k_cache, v_cache, tables = _cache(seq_lens, block_size, kv_heads, d, torch.float32, seed=40 + window)
    meta = _meta_tensors(tables, seq_lens, [1] * len(seq_lens), block_size)
    q = torch.randn(len(seq_lens), heads, d)
    out = ta.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        d**-0.5,
        window,
        num_partitions=4,
        block_n=16,
        out=_poisoned(q),
    )
    _check_all(out, q, k_cache, v_cache, tables, [1] * len(seq_lens), seq_lens, d**-0.5, window)
    # varlen: verify runs and prompt chunks longer than the window, small tiles
    query_lens = [n for _, n in PREFILL_SHAPES]
    seq_lens = [c + n for c, n in PREFILL_SHAPES]
    k_cache, v_cache, tables = _cache(seq_lens, block_size, kv_heads, d, torch.float32, seed=50 + window)
    meta = _meta_tensors(tables, seq_lens, query_lens, block_size)
    q = torch.randn(meta.num_tokens, heads, d)
    out = ta.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        d**-0.5,
        window,
        out=_poisoned(q),
        block_m=16,
        block_n=16,
    )
    _check_all(out, q, k_cache, v_cache, tables, query_lens, seq_lens, d**-0.5, window)


# ------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision(dtype):
    d, block_size, heads, kv_heads = 32, 16, 8, 2
    seq_lens = _boundary_lens(block_size, 32)
    k_cache, v_cache, tables = _cache(seq_lens, block_size, kv_heads, d, dtype, seed=60)
    meta = _meta_tensors(tables, seq_lens, [1] * len(seq_lens), block_size)
    q = torch.randn(len(seq_lens), heads, d).to(dtype)
    out = ta.paged_decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, d**-0.5, num_partitions=4, block_n=16, out=_poisoned(q)
    )
    _check_all(out, q, k_cache, v_cache, tables, [1] * len(seq_lens), seq_lens, d**-0.5, None)
    query_lens = [n for _, n in PREFILL_SHAPES]
    seq_lens = [c + n for c, n in PREFILL_SHAPES]
    k_cache, v_cache, tables = _cache(seq_lens, block_size, kv_heads, d, dtype, seed=61)
    meta = _meta_tensors(tables, seq_lens, query_lens, block_size)
    q = torch.randn(meta.num_tokens, heads, d).to(dtype)
    out = ta.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        d**-0.5,
        out=_poisoned(q),
    )
    _check_all(out, q, k_cache, v_cache, tables, query_lens, seq_lens, d**-0.5, None)


# ------------------------------------------------------------------------------ entry point


def test_paged_attention_matches_twin_and_picks_the_kernel():
    """The reference's signature: decode kernel when every sequence brings one token, the
    varlen kernel otherwise; both agree with the twin."""
    d, block_size, heads, kv_heads = 16, 16, 8, 2
    seq_lens = [3, 40, 600]  # tables of 640 tokens: three sequences split 2 ways, the merge runs
    k_cache, v_cache, tables = _cache(seq_lens, block_size, kv_heads, d, torch.float32, seed=70)
    meta = _meta_tensors(tables, seq_lens, [1, 1, 1], block_size)
    q = torch.randn(3, heads, d)
    assert plan.decode_num_partitions(3, kv_heads, meta.block_tables.shape[1] * block_size) == 2
    out = ta.paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    assert torch.equal(out, ta.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, d**-0.5))
    _check_all(out, q, k_cache, v_cache, tables, [1, 1, 1], seq_lens, d**-0.5, None)

    meta = _meta_tensors(tables, seq_lens, [1, 6, 3], block_size)
    q = torch.randn(10, heads, d)
    out = ta.paged_attention(q, k_cache, v_cache, meta, d**-0.5, 100)
    prefill = ta.paged_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 6, d**-0.5, 100
    )
    assert torch.equal(out, prefill)
    _check_all(out, q, k_cache, v_cache, tables, [1, 6, 3], seq_lens, d**-0.5, 100)


def test_rejects_bad_arguments():
    k_cache, v_cache, _ = _cache([16], 16, 2, 16, torch.float32, seed=0)
    bt, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    q = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match="num_partitions must be >= 1"):
        ta.paged_decode_attention(q, k_cache, v_cache, bt, lens, 1.0, num_partitions=0)
    with pytest.raises(ValueError, match="sliding_window"):
        ta.paged_decode_attention(q, k_cache, v_cache, bt, lens, 1.0, 0)
    with pytest.raises(ValueError, match="do not fit"):
        ta.paged_decode_attention(torch.randn(1, 3, 16), k_cache, v_cache, bt, lens, 1.0)
    with pytest.raises(ValueError, match="out must be"):
        ta.paged_decode_attention(q, k_cache, v_cache, bt, lens, 1.0, out=torch.empty(1, 8, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="block_n 24 must be a power of two"):
        ta.paged_decode_attention(q, k_cache, v_cache, bt, lens, 1.0, block_n=24)
    with pytest.raises(ValueError, match="block_m 24 must be a power of two"):
        qsl = torch.tensor([0, 1], dtype=torch.int32)
        ta.paged_prefill_attention(q, k_cache, v_cache, bt, lens, qsl, 1, 1.0, block_m=24)
