"""Block pool and block tables: invariants under random workloads."""

from __future__ import annotations

import random

import pytest

from draftwise.worker.core.block_manager import BlockManager, BlockPool, BlockPoolExhausted


def test_allocate_release_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    pool.share(a[:1])
    assert pool.ref_count(a[0]) == 2
    pool.release(a)
    assert pool.num_free == 3 and pool.ref_count(a[0]) == 1
    pool.check([[a[0]]])
    pool.release([a[0]])
    pool.check([])
    assert pool.num_free == 4


def test_errors():
    pool = BlockPool(2)
    with pytest.raises(BlockPoolExhausted):
        pool.allocate(3)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(ValueError, match="released more often"):
        pool.release([b])
    with pytest.raises(ValueError, match="free and cannot be shared"):
        pool.share([b])
    with pytest.raises(ValueError):
        BlockPool(0)


def test_check_detects_broken_invariants():
    pool = BlockPool(3)
    a = pool.allocate(2)
    with pytest.raises(AssertionError, match="owned"):
        pool.check([a[:1]])  # one allocated block has no owner
    with pytest.raises(AssertionError, match="owned"):
        pool.check([a, a[:1]])  # a block owned twice with one reference


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_grow_shrink_free_random(block_size):
    rng = random.Random(block_size)
    bm = BlockManager(40, block_size)
    tables: dict[int, list[int]] = {}
    lengths: dict[int, int] = {}
    for _ in range(2000):
        op = rng.random()
        if op < 0.5:
            i = rng.randrange(10)
            t = tables.setdefault(i, [])
            n = lengths.get(i, 0) + rng.randint(1, 3 * block_size)
            free_before = bm.num_free_blocks
            if bm.grow(t, n):
                lengths[i] = n
                assert len(t) == bm.blocks_for(n)
            else:
                assert bm.num_free_blocks == free_before  # unchanged on failure
        elif op < 0.7 and tables:
            i = rng.choice(list(tables))
            n = rng.randint(0, lengths.get(i, 0))
            bm.shrink(tables[i], n)
            lengths[i] = min(lengths.get(i, 0), n)
            assert len(tables[i]) <= bm.blocks_for(n)
        elif tables:
            i = rng.choice(list(tables))
            bm.free(tables.pop(i))
            lengths.pop(i, None)
        bm.pool.check(tables.values())
        all_blocks = [b for t in tables.values() for b in t]
        assert len(all_blocks) == len(set(all_blocks)), "a block owned twice"
    for t in tables.values():
        bm.free(t)
    bm.pool.check([])
    assert bm.num_free_blocks == 40
