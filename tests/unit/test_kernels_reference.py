"""The torch reference twins against naive dense computations, and the dispatch point."""

from __future__ import annotations

import random

import pytest
import torch

from draftwise.kernels import AttentionMetadata, dispatch, get_attention_backend, reference


def _naive(q, k, v, q_pos, window):  # q [n, H, D]; k, v [L, Hkv, D]; q_pos [n]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / q.shape[-1] ** 0.5
    kp = torch.arange(k.shape[0])[None, :]
    mask = kp <= q_pos[:, None]
    if window is not None:
        mask &= kp > q_pos[:, None] - window
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_paged_attention_matches_dense(block_size, window, heads, kv_heads):
    torch.manual_seed(0)
    rng = random.Random(block_size * 31 + heads)
    d = 8
    # (context before, new tokens): decode, verify rounds of several lengths, short and long
    # prompt chunks (every group of SHORT_GROUP_BOUNDS, some with more than one sequence)
    shapes = [(0, 1), (9, 1), (20, 4), (7, 3), (5, 6), (2, 12), (0, 40), (13, 37), (3, 32), (0, 33)]
    seq_lens = [c + n for c, n in shapes]
    need = [-(-s // block_size) for s in seq_lens]
    pool = list(range(sum(need) + 3))
    rng.shuffle(pool)
    tables, i = [], 0
    for n in need:
        tables.append(pool[i : i + n])
        i += n
    k_cache = torch.randn(len(pool), block_size, kv_heads, d)
    v_cache = torch.randn(len(pool), block_size, kv_heads, d)
    ctx_k = [torch.randn(s, kv_heads, d) for s in seq_lens]
    ctx_v = [torch.randn(s, kv_heads, d) for s in seq_lens]
    for t, ks, vs in zip(tables, ctx_k, ctx_v, strict=True):  # earlier context, already cached
        for p in range(ks.shape[0]):
            k_cache[t[p // block_size], p % block_size] = ks[p]
            v_cache[t[p // block_size], p % block_size] = vs[p]
    meta = AttentionMetadata.build(
        query_lens=[n for _, n in shapes], seq_lens=seq_lens, block_tables=tables, block_size=block_size
    )
    q = torch.randn(meta.num_tokens, heads, d)
    out = reference.paged_attention(q, k_cache, v_cache, meta, d**-0.5, window)
    row = 0
    for (c, n), ks, vs in zip(shapes, ctx_k, ctx_v, strict=True):
        want = _naive(q[row : row + n], ks, vs, torch.arange(c, c + n), window)
        torch.testing.assert_close(out[row : row + n], want, atol=1e-5, rtol=1e-5)
        row += n


def test_short_sequences_are_padded_only_to_their_groups_longest():
    """Sixteen decode rows beside one verify round of five: the decode rows form their own
    group of one query each (padded to five, their attention cost several times a decode
    step's), and each group's output equals attending it alone."""
    torch.manual_seed(1)
    query_lens = [1] * 15 + [5]
    seq_lens = [30 + 2 * i for i in range(16)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(16)]
    meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=16)
    plan = reference._plan(meta)
    assert [g.token_index.shape for g in plan.short] == [(15, 1), (1, 5)] and not plan.long
    k_cache, v_cache = torch.randn(64, 16, 2, 8), torch.randn(64, 16, 2, 8)
    q = torch.randn(meta.num_tokens, 4, 8)
    out = reference.paged_attention(q, k_cache, v_cache, meta, 8**-0.5)
    alone = AttentionMetadata.build(
        query_lens=[1] * 15, seq_lens=seq_lens[:15], block_tables=tables[:15], block_size=16
    )
    torch.testing.assert_close(out[:15], reference.paged_attention(q[:15], k_cache, v_cache, alone, 8**-0.5))
    assert len(reference._plan(alone).short) == 1 and reference._plan(alone).short[0].dense


def test_metadata_slot_mapping():
    meta = AttentionMetadata.build(query_lens=[3, 1], seq_lens=[5, 2], block_tables=[[2, 0, 3], [1]], block_size=2)
    # seq 0 positions 2, 3, 4 -> blocks 0, 0, 3; seq 1 position 1 -> block 1
    assert meta.slot_mapping.tolist() == [0, 1, 6, 3]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    k = torch.arange(4, dtype=torch.float32)[:, None, None].expand(4, 1, 2).contiguous()
    kc = torch.full((4, 2, 1, 2), -1.0)
    vc = torch.full((4, 2, 1, 2), -1.0)
    reference.write_kv_cache(k, k, kc, vc, meta.slot_mapping)
    assert kc.view(-1, 2)[:, 0].tolist() == [0, 1, -1, 3, -1, -1, 2, -1]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(query_lens=[0], seq_lens=[3], block_tables=[[0]]), "query length"),
        (dict(query_lens=[4], seq_lens=[3], block_tables=[[0]]), "query length"),
        (dict(query_lens=[1], seq_lens=[5], block_tables=[[0]]), "cannot hold"),
        (dict(query_lens=[1, 1], seq_lens=[1], block_tables=[[0]]), "one entry per sequence"),
    ],
)
def test_metadata_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(block_size=4, **kwargs)


def test_rms_norm_with_residual():
    torch.manual_seed(0)
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    out, res = reference.rms_norm(x, w, 1e-6, r)
    s = x + r
    torch.testing.assert_close(res, s)
    torch.testing.assert_close(out, w * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_dispatch_picks_twin_on_cpu():
    from draftwise.worker.model import cpu_attention, cpu_matmul, llama  # noqa: F401 - the model registers its CPU ops

    library = {"rms_norm": cpu_matmul.rms_norm, "paged_attention": cpu_attention.paged_attention}
    library["write_kv_cache"] = cpu_attention.write_kv_cache
    for op in dispatch.OPS:
        if op in library:  # the kernel library's (each calls this twin itself where it does not apply)
            assert dispatch.impl(op, "cpu") is library[op]
            assert dispatch.impl(op, "cpu", prefer_reference=True) is getattr(reference, op)
            continue
        assert dispatch.backend_name(op, "cpu") == "torch"
        assert dispatch.impl(op, "cpu") is getattr(reference, op)
    assert get_attention_backend("cpu").name == "draftwise-cpu"
    assert get_attention_backend("cpu", prefer_reference=True).name == "torch"
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.impl("nope", "cpu")


@pytest.mark.parametrize("n,heads,kv_heads,d", [(33, 4, 2, 8), (100, 9, 3, 64), (300, 9, 3, 64), (257, 4, 4, 16)])
def test_a_first_prompt_chunk_takes_torchs_causal_path_with_the_masks_bits(n, heads, kv_heads, d):
    """A sequence's first chunk (no earlier context, no window) runs torch's attention with is_causal, which skips
    the blocks above the diagonal; the result is the explicit mask's, bit for bit."""
    torch.manual_seed(n)
    bs = 16
    nb = -(-n // bs)
    k_cache, v_cache = torch.randn(nb + 2, bs, kv_heads, d), torch.randn(nb + 2, bs, kv_heads, d)
    table = list(range(2, nb + 2))[::-1]  # blocks out of order
    meta = AttentionMetadata.build(query_lens=[n], seq_lens=[n], block_tables=[table], block_size=bs)
    q = torch.randn(n, heads, d)
    got = reference.paged_attention(q, k_cache, v_cache, meta, d**-0.5, None)
    blocks = torch.tensor(table)
    keys = k_cache.index_select(0, blocks).view(-1, kv_heads, d)[:n].transpose(0, 1)[None]
    vals = v_cache.index_select(0, blocks).view(-1, kv_heads, d)[:n].transpose(0, 1)[None]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, vals, attn_mask=mask, scale=d**-0.5, enable_gqa=heads != kv_heads
    )[0].transpose(0, 1)
    assert torch.equal(got, want)
