"""Tensor-parallel shard plans: every head, MLP column and vocabulary row is held by exactly
the ranks it should be, query heads always read their own key/value heads, and the plans a
model cannot have are refused with the reason."""

from __future__ import annotations

import pytest

from draftwise.worker.model.model_config import ModelConfig
from draftwise.worker.model.sharding import Shard, split


def cfg(heads: int, kv: int, inter: int = 96, vocab: int = 1000, head_dim: int = 8) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=heads * head_dim,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
    )


@pytest.mark.parametrize("n,parts", [(9, 2), (3, 2), (8, 4), (7, 3), (5, 5), (1536, 2)])
def test_split_is_a_contiguous_even_cover(n: int, parts: int) -> None:
    spans = [split(n, parts, i) for i in range(parts)]
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    sizes = [b - a for a, b in spans]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    "heads,kv,size",
    [(8, 4, 2), (8, 4, 4), (9, 3, 2), (9, 3, 3), (8, 2, 4), (8, 1, 4), (8, 8, 8), (32, 8, 4), (4, 4, 1)],
)
def test_plans_cover_every_head_once_and_read_their_own_kv(heads: int, kv: int, size: int) -> None:
    c = cfg(heads, kv)
    shards = [Shard.plan(c, r, size) for r in range(size)]
    group = heads // kv
    q_owner = [r for s in shards for r in [s.rank] * (s.q_heads[1] - s.q_heads[0])]
    assert len(q_owner) == heads  # each query head on exactly one rank
    assert [h for s in shards for h in range(*s.q_heads)] == list(range(heads))
    for s in shards:
        assert s.q_heads[1] > s.q_heads[0], "every rank has query heads"
        for h in range(*s.q_heads):  # a query head's key/value head is on its rank
            assert s.kv_heads[0] <= h // group < s.kv_heads[1]
        local = s.local_config(c)
        assert local.num_attention_heads % local.num_key_value_heads == 0 or kv < size
    kv_held = [h for s in shards for h in range(*s.kv_heads)]
    if kv >= size:
        assert kv_held == list(range(kv))  # split: each once
    else:
        assert sorted(kv_held) == sorted(list(range(kv)) * (size // kv))  # replicated evenly
    assert [c_ for s in shards for c_ in range(*s.intermediate)] == list(range(c.intermediate_size))


@pytest.mark.parametrize("vocab,size", [(1000, 2), (1001, 2), (8192, 4), (49152, 2), (7, 3)])
def test_vocabulary_rows_are_padded_equal_and_cover_once(vocab: int, size: int) -> None:
    c = cfg(8, 4, vocab=vocab) if size <= 4 else cfg(8, 8, vocab=vocab)
    shards = [Shard.plan(c, r, size) for r in range(size)]
    assert {s.vocab_rows for s in shards} == {-(-vocab // size)}
    assert [v for s in shards for v in range(*s.vocab)] == list(range(vocab))
    assert all(s.local_config(c).vocab_size == s.vocab_rows for s in shards)


def test_checkpoint_slices_follow_the_plan() -> None:
    c = cfg(9, 3, inter=1536, vocab=49152, head_dim=64)  # SmolLM2-135M's shape
    s0, s1 = Shard.plan(c, 0, 2), Shard.plan(c, 1, 2)
    assert (s0.kv_heads, s1.kv_heads) == ((0, 2), (2, 3))  # 3 key/value heads over 2 ranks: 2 and 1
    assert (s0.q_heads, s1.q_heads) == ((0, 6), (6, 9))
    layer = "model.layers.3."
    assert s1.slice_of(layer + "self_attn.q_proj.weight", c) == (0, (384, 576))
    assert s1.slice_of(layer + "self_attn.k_proj.weight", c) == (0, (128, 192))
    assert s1.slice_of(layer + "self_attn.v_proj.bias", c) == (0, (128, 192))
    assert s1.slice_of(layer + "self_attn.o_proj.weight", c) == (1, (384, 576))
    assert s1.slice_of(layer + "self_attn.o_proj.bias", c) is None  # added once, after the all-reduce
    assert s0.slice_of(layer + "mlp.gate_proj.weight", c) == (0, (0, 768))
    assert s1.slice_of(layer + "mlp.down_proj.weight", c) == (1, (768, 1536))
    assert s1.slice_of("model.embed_tokens.weight", c) == (0, (24576, 49152))
    assert s1.slice_of("lm_head.weight", c) == (0, (24576, 49152))
    assert s0.slice_of(layer + "input_layernorm.weight", c) is None
    assert s0.slice_of("model.norm.weight", c) is None


@pytest.mark.parametrize(
    "heads,kv,size,inter,match",
    [
        (8, 4, 16, 96, "more than the model's 8 attention heads"),
        (9, 3, 6, 96, None),  # 2 ranks per key/value head, 3 query heads each: fine
        (8, 2, 3, 96, "multiple of the model's 2 key/value heads"),
        (4, 1, 4, 2, "MLP width"),
    ],
)
def test_impossible_plans_are_refused(heads: int, kv: int, size: int, inter: int, match: str | None) -> None:
    c = cfg(heads, kv, inter=inter)
    if match is None:
        assert [Shard.plan(c, r, size).q_heads for r in range(size)][-1] == (8, 9)
        return
    with pytest.raises(ValueError, match=match):
        Shard.plan(c, 0, size)


def test_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        Shard.plan(cfg(8, 4), 2, 2)
