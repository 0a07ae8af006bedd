"""The prefix cache in the block pool and the scheduler, without a model.

The randomized test drives the real Scheduler and BlockManager through thousands of
operations (admissions that hit, miss and partly hit, chunked prefill, decoding with drafts
accepted and rejected, preemption under memory pressure, finishing, aborts, failures) while a
model of the KV cache records what every block holds: the salt and all tokens of the sequence
up to the block's end, written when the scheduler hands positions to a "forward pass". Each
step it checks the pool's invariants, that every block a request reuses holds exactly that
request's prefix (a cache hit never serves another tenant's or another prefix's KV, even
after eviction and reuse of the block), and at the end that nothing is left owned.
"""

from __future__ import annotations

import random

import pytest

from draftwise.worker.core.block_manager import BlockManager, BlockPool, chain_hashes
from draftwise.worker.core.request import FinishReason, Request, RequestStatus
from draftwise.worker.core.scheduler import Scheduler, SchedulerConfig
from draftwise.worker.sampling.sampling_params import SamplingParams

BS = 4


def _req(rid: str, prompt: list[int], salt: str = "", max_tokens: int = 100) -> Request:
    r = Request(
        request_id=rid,
        prompt=None,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(),
        max_tokens=max_tokens,
    )
    r.cache_salt = salt
    return r


def _advance(sched: Scheduler, out, token: int = 7) -> None:
    samples = [s.samples for s in out.scheduled]
    sched.update_from_output(out.scheduled, {})
    for s, sample in zip(out.scheduled, samples, strict=True):
        if sample:
            s.request.output_token_ids.append(token)


def _finish(sched: Scheduler, req: Request, reason: FinishReason = FinishReason.STOP) -> None:
    req.status = RequestStatus.FINISHED
    req.finish_reason = reason
    sched.remove(req)


def test_chain_hashes_depend_on_every_earlier_token_and_the_salt():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS, "", [])
    assert len(a) == 2  # full blocks only
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, "", [])[:2] == a
    assert (
        chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS, "", [])[1] != a[1]
    )  # the second block's hash sees the first's tokens
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, "tenant-b", [])[0] != a[0]
    # extending in pieces gives the same hashes as in one go
    part = chain_hashes([1, 2, 3, 4], BS, "", [])
    assert chain_hashes([5, 6, 7, 8], BS, "", part) == a


def test_second_request_starts_after_the_cached_prefix_and_the_cache_survives_free():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(20, BS, enable_prefix_caching=True))
    a = _req("a", list(range(10, 23)))  # 13 tokens: 3 full blocks
    sched.add(a)
    _advance(sched, sched.schedule())
    assert sched.blocks.pool.num_cached == 3
    _finish(sched, a)
    assert sched.blocks.num_free_blocks == 20  # cached blocks count as free
    b = _req("b", list(range(10, 23)) + [99, 98])
    sched.add(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 12 and b.prefill_start == 12
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 3)]
    assert sched.blocks.prefix_cache_stats.hits == 12
    # an identical prompt whose every token is cached still computes its last one
    c = _req("c", list(range(10, 22)))  # 12 tokens: 3 full blocks, all cached
    sched.add(c)
    out = sched.schedule()
    assert c.num_cached_tokens == 8 and [s.num_new_tokens for s in out.scheduled if s.request is c] == [4]


def test_salt_separates_tenants():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(20, BS, enable_prefix_caching=True))
    a = _req("a", list(range(20)), salt="key-a")
    sched.add(a)
    _advance(sched, sched.schedule())
    b = _req("b", list(range(20)), salt="key-b")
    sched.add(b)
    sched.schedule()
    assert b.num_cached_tokens == 0
    c = _req("c", list(range(20)), salt="key-a")
    sched.add(c)
    sched.schedule()
    assert c.num_cached_tokens == 16


def test_off_never_hashes_or_hits():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(20, BS))
    for rid in "ab":
        r = _req(rid, list(range(20)))
        sched.add(r)
        _advance(sched, sched.schedule())
        assert r.num_cached_tokens == 0 and not r.block_hashes
    assert sched.blocks.prefix_cache_stats.queries == 0 and sched.blocks.pool.num_cached == 0


def test_eviction_takes_never_cached_blocks_first_then_least_recently_freed():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, b"ha")
    pool.cache(b, b"hb")
    pool.release([b, a])  # b freed first: evicted first
    assert pool.num_free == 4 and pool.num_cached == 2
    c, d = pool.allocate(2)
    assert {c, d}.isdisjoint({a, b}) and pool.num_cached == 2  # the never-cached ones went first
    (e,) = pool.allocate(1)
    assert e == b and pool.lookup(b"hb") is None and pool.lookup(b"ha") == a
    pool.check([[c], [d], [e]])


def test_a_hit_on_a_block_in_use_shares_it_and_a_duplicate_is_not_cached_twice():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.cache(a, b"h")
    pool.touch(a)
    assert pool.ref_count(a) == 2
    (b,) = pool.allocate(1)
    pool.cache(b, b"h")  # computed the same block at the same time: stays uncached
    assert pool.lookup(b"h") == a and pool.num_cached == 1
    with pytest.raises(ValueError):
        pool.touch(b)
    pool.release([a, a, b])
    pool.check([])


def test_a_failed_request_offers_nothing_to_the_cache():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), BlockManager(20, BS, enable_prefix_caching=True))
    a = _req("a", list(range(20)))
    sched.add(a)
    out = sched.schedule()  # 8 tokens computed this step, not yet reported
    _finish(sched, a, FinishReason.ERROR)
    assert sched.blocks.pool.num_cached == 0
    del out


@pytest.mark.parametrize("seed", range(4))
def test_randomized_sharing_eviction_preemption_keep_invariants(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([12, 20, 40])
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=rng.choice([6, 16, 40]), max_num_seqs=6), bm)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(0, 14))] for _ in range(4)]
    salts = ["", "", "t1"]
    kv: dict[int, tuple] = {}  # block -> (salt, the sequence's tokens up to the block's end), once full
    live: list[Request] = []
    n = 0
    hits = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.15 and len(live) < 10:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 10))]
            r = _req(f"r{n}", prompt, rng.choice(salts), max_tokens=rng.randint(1, 12))
            n += 1
            sched.add(r)
            live.append(r)
        elif op < 0.2 and live:
            r = rng.choice(live)
            _finish(sched, r, rng.choice([FinishReason.ABORT, FinishReason.ERROR]))
            live.remove(r)
        before = {r.request_id: r.num_computed_tokens for r in sched.waiting}
        out = sched.schedule({r.request_id: rng.randint(0, 3) for r in sched.running})
        for s in out.scheduled:  # a request admitted this step: what it reuses is its own prefix
            r = s.request
            if r.request_id in before and r.prefill_start:
                hits += 1
                toks = r.all_token_ids
                for i in range(r.prefill_start // BS):
                    assert kv[r.block_table[i]] == (r.cache_salt, tuple(toks[: (i + 1) * BS]))
        # the forward pass writes each scheduled position's KV (drafts with made-up tokens)
        accepted = {}
        for s in out.scheduled:
            r = s.request
            toks = r.all_token_ids
            drafts = [rng.randrange(1000) for _ in range(s.num_draft_tokens)]
            seq = toks + drafts
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens):
                if (pos + 1) % BS == 0:
                    kv[r.block_table[pos // BS]] = (r.cache_salt, tuple(seq[: pos + 1]))
            accepted[r.request_id] = rng.randint(0, s.num_draft_tokens)
            if s.num_draft_tokens:  # accepted drafts become the request's tokens (like the engine)
                s.request._accepted = drafts[: accepted[r.request_id]]  # type: ignore[attr-defined]
        samples = [s.samples for s in out.scheduled]
        sched.update_from_output(out.scheduled, accepted)
        for s, sample in zip(out.scheduled, samples, strict=True):
            r = s.request
            if not sample:
                continue
            r.output_token_ids.extend(getattr(r, "_accepted", []))
            r.output_token_ids.append(rng.randrange(1000))
            r._accepted = []  # type: ignore[attr-defined]
            if len(r.output_token_ids) >= r.max_tokens:
                _finish(sched, r)
                live.remove(r)
        bm.pool.check(r.block_table for r in [*sched.running, *sched.waiting])
        for r in sched.running:
            assert r.num_computed_tokens <= r.num_tokens
    for r in list(live):
        _finish(sched, r, FinishReason.ABORT)
    bm.pool.check([])
    assert bm.num_free_blocks == num_blocks
    stats = bm.prefix_cache_stats
    assert hits > 0 and 0 < stats.hits <= stats.queries
    assert bm.pool.num_evictions > 0  # cached blocks were handed out again
    assert sched.num_preemptions > 0 or num_blocks == 40
