"""The suffix proposer (worker/speculative/suffix.py): drafts from earlier outputs of the same
tenant and from the request's own tokens, and changes nothing in what the engine outputs.

- the lookup, kept incremental (O(1) per step), finds what a brute-force search finds;
- the cache keeps its token budget, drops its oldest outputs first, and its index never
  points at a dropped one;
- greedy output equals plain greedy, batched under chunked prefill and forced preemption, on an
  agent-like workload whose requests repeat earlier outputs (drafts from the cache accepted);
- seeded sampling equals plain seeded sampling;
- tenant A's outputs are never proposed to tenant B (the chi-square check for sampled output
  is in test_spec_distribution.py).
"""

from __future__ import annotations

import random

import pytest

from draftwise.worker.core.request import FinishReason, Request, RequestStatus
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.speculative.suffix import CONTEXT, MAX_DEPTH, SuffixCache, SuffixProposer
from tests.engine.test_spec_exactness import _code_ids, _config, run_together

SUFFIX = {"speculative_method": "suffix"}


def _depth(src: list[int], p: int, tail: list[int]) -> int:
    d = 0
    while d < MAX_DEPTH and d < p and d < len(tail) and src[p - 1 - d] == tail[-1 - d]:
        d += 1
    return d


def _brute(seqs: list[list[int]], own: list[int], k: int, min_depth: int) -> list[int]:
    """What the proposer must draft, by brute force: the request's own most recent earlier
    occurrence of its last CONTEXT tokens, against every cached occurrence (the most recent of
    the deepest); own wins ties; at most min(k, depth) tokens, none below min_depth."""
    tail, n = own[-MAX_DEPTH:], len(own)
    own_d, own_drafts = 0, []
    for p in range(CONTEXT, n):
        if own[p - CONTEXT : p] == own[-CONTEXT:]:
            d = _depth(own, p, tail)
            own_d, own_drafts = d, own[p : min(n, p + min(k, d))]
    cache_d, cache_drafts = 0, []
    for src in seqs:
        for p in range(CONTEXT, len(src)):
            if src[p - CONTEXT : p] == own[-CONTEXT:]:
                d = _depth(src, p, tail)
                if d >= cache_d:
                    cache_d, cache_drafts = d, src[p : p + min(k, d)]
    depth, drafts = (cache_d, cache_drafts) if cache_d > own_d else (own_d, own_drafts)
    return drafts if depth >= min_depth else []


def _req(rid: str, tokens: list[int], salt: str = "") -> Request:
    r = Request(
        request_id=rid, prompt=None, prompt_token_ids=list(tokens), sampling_params=SamplingParams(), max_tokens=9
    )
    r.cache_salt = salt
    return r


@pytest.mark.parametrize("seed", range(5))
def test_lookup_finds_the_deepest_match_incrementally(seed):
    rng = random.Random(seed)
    alphabet = rng.choice([5, 9])
    prop = SuffixProposer(max_tokens=10_000)
    earlier = [[rng.randrange(alphabet) for _ in range(rng.randint(5, 60))] for _ in range(4)]
    for s in earlier:
        prop.cache.add("", s)
    req = _req("r", [rng.randrange(alphabet) for _ in range(5)])
    for _ in range(80):  # grow the request one token at a time, looking up at each step
        k = rng.randint(1, 6)
        assert prop.lookup(req, k) == _brute(earlier, req.all_token_ids, k, prop.min_depth)
        req.output_token_ids.append(rng.randrange(alphabet))
    prop.release(req)
    prop.check_idle()


def test_the_cache_keeps_its_budget_and_drops_the_oldest():
    cache = SuffixCache(max_tokens=100)
    for i in range(30):
        cache.add("", [i, i + 1, i + 2, i + 3, i + 4, 7, 8])
        cache.check()
    assert cache.num_tokens <= 100 and len(cache) == 100 // 7
    assert cache.match("", [29, 30, 31, 32])[0] == 4  # the newest is there
    assert cache.match("", [0, 1, 2, 3])[0] == 0  # the oldest was dropped


def test_a_tenants_outputs_are_never_proposed_to_another():
    prop = SuffixProposer()
    a = _req("a", [5, 6, 7, 8, 9, 10, 11, 12], salt="tenant-a")
    a.output_token_ids += [40, 41, 42, 43, 44, 45, 46, 47, 48]
    a.status, a.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
    prop.release(a)  # its output goes into tenant a's cache
    probe = [40, 41, 42, 43, 44]
    assert prop.lookup(_req("b", probe, salt="tenant-b"), 4) == []
    assert prop.lookup(_req("a2", probe, salt="tenant-a"), 4) == [45, 46, 47, 48]
    prop.release(_req("b", []))
    prop.release(_req("a2", []))


def _agent_workload(seed: int) -> list[tuple[str, list[int], SamplingParams, int]]:
    """Requests whose prompts quote code, in rounds: later rounds ask again about the same
    snippets, so their answers repeat earlier answers (what an agent editing code does)."""
    rng = random.Random(seed)
    code = _code_ids()
    snippets = [code[a : a + rng.randint(20, 60)] for a in rng.sample(range(0, len(code) - 80), 6)]
    reqs = []
    for i in range(30):
        prompt = rng.choice(snippets)
        params = SamplingParams(temperature=0, max_tokens=rng.randint(16, 48), ignore_eos=True)
        reqs.append((f"r{i}", list(prompt), params, i // 2))
    return reqs


@pytest.fixture(scope="module")
def agent():
    reqs = _agent_workload(3)
    engine = LLMEngine(_config(num_kv_blocks=128, enable_prefix_caching=False))
    ref = {}
    for rid, prompt, params, _ in reqs:
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                ref[o.request_id] = o.outputs[0].token_ids
    return reqs, ref


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_is_exact_batched_with_chunked_prefill_and_preemption(agent, k):
    reqs, ref = agent
    engine = LLMEngine(
        _config(
            block_size=16,
            max_num_batched_tokens=48,
            max_num_seqs=12,
            num_kv_blocks=32,  # forces preemption
            num_speculative_tokens=k,
            speculative_adaptive=False,
            **SUFFIX,
        )
    )
    out = run_together(reqs, engine)
    assert engine.scheduler.num_preemptions > 0
    assert [rid for rid in ref if out[rid] != ref[rid]] == []
    totals = engine.spec_totals
    assert 0 < totals["accepted"] <= totals["proposed"], totals
    assert len(engine.spec.proposer.cache) > 0  # type: ignore[union-attr]
    engine.check_idle_invariants()


def _seeded(spec: dict) -> dict[str, list[int]]:
    engine = LLMEngine(_config(num_kv_blocks=128, max_num_seqs=4, **spec))
    out = {}
    for i, (rid, prompt, _, _) in enumerate(_agent_workload(4)[:16]):
        params = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=70 + i)
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                out[o.request_id] = o.outputs[0].token_ids
    engine.check_idle_invariants()
    return out


def test_seeded_sampling_equals_plain_seeded():
    assert _seeded(SUFFIX) == _seeded({})
