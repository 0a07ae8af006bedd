"""The prefix cache changes nothing in what the engine outputs, and nothing leaks.

The workload: requests that share a few "system prompts" (slices of real code, 31 to 200
tokens) followed by their own text, and later turns of some of them (prompt + the earlier
answer + a new line), arriving over time. The reference is plain greedy decoding, alone,
with the cache off. With the cache on:

- alone (each request after the previous one) and batched, under chunked prefill and forced
  preemption, and with every proposer (draft model, n-gram, EAGLE, Medusa): equal, token for
  token, with cache hits along the way, and every block free (cached ones counted) once idle;
- the hit count with speculation on equals the hit count with it off, request by request;
- seeded sampling: equal to seeded sampling without the cache;
- a pool small enough to evict cached prefixes: still exact;
- a request sharing cached blocks that fails in the forward pass or is aborted mid-prefill
  leaves the others exact and nothing owned;
- the draft model's own pool finds cached blocks too (it caches under the target's hashes);
- a continuation (failover, resume) finds its prompt and tokens so far cached, and goes on exactly.
"""

from __future__ import annotations

import random

import pytest

from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.sampling.sampling_params import SamplingParams
from tests.engine.test_spec_exactness import _code_ids, _config, run_together

Req = tuple[str, list[int], SamplingParams, int]
SPEC = {
    "draft": {"speculative_model": "default"},
    "ngram": {"speculative_method": "ngram"},
    "eagle": {"speculative_method": "eagle"},
    "medusa": {"speculative_method": "medusa"},
}


def _alone(reqs: list[Req], **kw) -> tuple[dict[str, list[int]], dict[str, int], LLMEngine]:
    """Each request run to the end before the next; outputs and cached tokens per request."""
    engine = LLMEngine(_config(num_kv_blocks=128, **kw))
    out, cached = {}, {}
    for rid, prompt, params, _ in reqs:
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                out[o.request_id] = o.outputs[0].token_ids
                cached[o.request_id] = o.num_cached_tokens
            engine.check_invariants()
    engine.check_idle_invariants()
    return out, cached, engine


def _shared(seed: int, n: int = 24) -> list[Req]:
    rng = random.Random(seed)
    code = _code_ids()
    systems = [code[a : a + n_] for a, n_ in [(0, 200), (3000, 67), (6000, 129), (9000, 31)]]
    reqs = []
    for i in range(n):
        tail = rng.randrange(len(code) - 40)
        prompt = rng.choice(systems) + code[tail : tail + rng.randint(1, 30)]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(4, 24), ignore_eos=True)
        reqs.append((f"r{i}", prompt, params, rng.randint(0, 30)))
    return reqs


@pytest.fixture(scope="module")
def workload() -> tuple[list[Req], dict[str, list[int]]]:
    """First turns, then second turns built from the reference answers (prompt + answer + a
    new line of code), all with their reference outputs (cache off)."""
    first = _shared(7)
    ref, _, _ = _alone(first, enable_prefix_caching=False)
    code = _code_ids()
    rng = random.Random(8)
    turns = []
    for i, (rid, prompt, params, step) in enumerate(first[:12]):
        tail = rng.randrange(len(code) - 20)
        turns.append((f"t{i}", prompt + ref[rid] + code[tail : tail + 12], params, step + 40))
    ref2, _, _ = _alone(turns, enable_prefix_caching=False)
    return first + turns, ref | ref2


def _mismatched(out: dict[str, list[int]], ref: dict[str, list[int]]) -> list[str]:
    assert set(out) == set(ref)
    return [rid for rid in ref if out[rid] != ref[rid]]


def test_alone_is_exact_and_hits(workload):
    reqs, ref = workload
    out, cached, engine = _alone(reqs)
    assert not _mismatched(out, ref)
    assert sum(1 for c in cached.values() if c) >= len(reqs) // 2
    assert all(cached[rid] % engine.config.block_size == 0 and cached[rid] < len(p) for rid, p, _, _ in reqs)
    assert min(cached[f"t{i}"] for i in range(12)) >= 16  # a second turn reuses its first turn's blocks


def test_batched_with_chunked_prefill_and_preemption_is_exact(workload):
    reqs, ref = workload
    engine = LLMEngine(_config(block_size=16, max_num_batched_tokens=48, max_num_seqs=10, num_kv_blocks=40))
    out = run_together(reqs, engine)
    assert engine.scheduler.num_preemptions > 0, "the workload did not force any preemption"
    assert engine.prefix_cache_stats.hits > 0
    assert not _mismatched(out, ref)
    engine.check_idle_invariants()


def test_eviction_of_cached_prefixes_stays_exact(workload):
    reqs, ref = workload
    engine = LLMEngine(_config(block_size=16, max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=36))
    out = run_together(reqs, engine)
    assert engine.blocks.pool.num_evictions > 0
    assert not _mismatched(out, ref)
    engine.check_idle_invariants()


@pytest.mark.parametrize("method", list(SPEC))
def test_speculation_with_the_cache_is_exact(workload, method):
    reqs, ref = workload
    engine = LLMEngine(
        _config(
            block_size=16,
            max_num_batched_tokens=64,
            max_num_seqs=10,
            num_kv_blocks=48,
            num_speculative_tokens=3,
            speculative_adaptive=False,
            **SPEC[method],
        )
    )
    out = run_together(reqs, engine)
    assert engine.prefix_cache_stats.hits > 0
    if engine.proposer is not None:  # the draft model's pool caches its blocks under the same hashes
        assert engine.proposer.blocks.prefix_cache_stats.hits > 0
    assert engine.spec_totals["accepted"] > 0, engine.spec_totals
    assert not _mismatched(out, ref)
    engine.check_idle_invariants()


@pytest.mark.parametrize("method", list(SPEC))
def test_speculation_does_not_change_the_hits(workload, method):
    reqs, ref = workload
    _, plain, _ = _alone(reqs[:16])
    out, cached, engine = _alone(reqs[:16], **SPEC[method])
    assert cached == plain and sum(plain.values()) > 0
    assert engine.spec_totals["proposed"] > 0
    assert not _mismatched(out, {rid: ref[rid] for rid in out})


def _seeded(on: bool) -> dict[str, list[int]]:
    engine = LLMEngine(_config(num_kv_blocks=128, max_num_seqs=6, enable_prefix_caching=on))
    out = {}
    for i, (rid, prompt, _, _) in enumerate(_shared(9, 16)):
        params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, seed=50 + i)
        engine.add_request(rid, prompt, params)
        if i % 4 == 3:  # a few at a time, so that later ones find earlier ones' blocks
            while engine.has_unfinished_requests():
                for o in engine.step().finished:
                    out[o.request_id] = o.outputs[0].token_ids
    assert (engine.prefix_cache_stats.hits > 0) == on
    engine.check_idle_invariants()
    return out


def test_seeded_sampling_equals_seeded_without_the_cache():
    assert _seeded(True) == _seeded(False)


def test_a_request_sharing_blocks_that_fails_or_is_aborted_disturbs_nothing(workload):
    reqs, ref = workload
    engine = LLMEngine(_config(block_size=16, max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=64))
    first = reqs[:6]
    for rid, prompt, params, _ in first:  # fill the cache
        engine.add_request(rid, prompt, params)
    run_together([], engine)
    # the same prompts again: they share cached blocks; one fails in the forward pass, one is
    # aborted while its prompt is still being computed
    again = [(f"{rid}b", p, s, 0) for rid, p, s, _ in first]
    again[1] = ("r1b", again[1][1] + _code_ids()[:120], again[1][2], 0)  # 120 tokens past its cached prefix
    for rid, prompt, params, _ in again:
        engine.add_request(rid, prompt, params)
    bad = engine.requests["r0b"]
    original = engine.runner.run

    def run(chunks):
        if any(c.block_table is bad.block_table for c in chunks):
            raise ValueError("injected: a bad sequence in the forward pass")
        return original(chunks)

    engine.runner.run = run  # type: ignore[method-assign]
    aborted = False
    outs, step = {}, 0
    try:
        while engine.has_unfinished_requests():
            res = engine.step()
            engine.check_invariants()
            step += 1
            target = engine.requests.get("r1b")
            if not aborted and target is not None and target.num_computed_tokens > target.prefill_start > 0:
                assert target.num_computed_tokens < target.num_prompt_tokens  # mid-prefill
                assert engine.blocks.pool.ref_count(target.block_table[0]) >= 1
                aborted = engine.abort_request("r1b")
            for o in res.finished:
                outs[o.request_id] = o
    finally:
        del engine.runner.run
    assert aborted
    assert outs["r0b"].outputs[0].finish_reason == "error" and outs["r1b"].outputs[0].finish_reason == "abort"
    for rid, *_ in first[2:]:
        assert outs[f"{rid}b"].outputs[0].token_ids == ref[rid]
        assert outs[f"{rid}b"].num_cached_tokens > 0
    engine.check_idle_invariants()
    # the cache still serves the same prompts, exactly, afterwards
    for rid, prompt, params, _ in first:
        engine.add_request(f"{rid}c", prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            outs[o.request_id] = o
    assert all(outs[f"{rid}c"].outputs[0].token_ids == ref[rid] for rid, *_ in first)
    assert all(outs[f"{rid}c"].num_cached_tokens > 0 for rid, *_ in first)
    engine.check_idle_invariants()


def test_a_continuation_finds_its_prompt_and_tokens_so_far_cached(workload):
    """A failover or resume resubmission (prompt + the tokens so far as its continuation) landing
    on the worker that ran the request computes only what is not cached, and goes on exactly."""
    reqs, ref = workload
    rid, prompt, params, _ = next(r for r in reqs if len(ref[r[0]]) >= 20)
    engine = LLMEngine(_config(num_kv_blocks=128))
    engine.add_request(rid, prompt, params)
    run_together([], engine)
    before = engine.prefix_cache_stats.hits
    cut = 18
    engine.add_request("again", prompt, params, continuation=ref[rid][:cut])
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            out[o.request_id] = o
    bs = engine.config.block_size
    hit = engine.prefix_cache_stats.hits - before
    assert hit == ((len(prompt) + cut - 1) // bs) * bs > len(prompt) - bs  # the prompt and the tokens so far
    assert out["again"].outputs[0].token_ids == ref[rid]
    assert out["again"].num_cached_tokens == min(hit, len(prompt))
    engine.check_idle_invariants()
