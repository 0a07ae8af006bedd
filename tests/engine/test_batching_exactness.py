"""Continuous batching, chunked prefill and preemption change nothing: every request
produces exactly the tokens it produces alone (greedy), and the block pool ends empty."""

from __future__ import annotations

import random

import pytest

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.sampling.sampling_params import SamplingParams

MAX_MODEL_LEN = 512


def _requests(n: int, seed: int, vocab: int) -> list[tuple[str, list[int], SamplingParams, int]]:
    """(id, prompt ids, params, arrival step) with prompts of 1-300 tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.choice([1, 2, rng.randint(1, 40), rng.randint(1, 300), rng.randint(200, 300)])
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(plen - 1)]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 48), ignore_eos=True)
        out.append((f"r{i}", prompt, params, rng.randint(0, 60)))
    return out


def run_alone(reqs) -> dict[str, list[int]]:
    engine = LLMEngine(
        EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, skip_tokenizer_init=True)
    )
    out = {}
    for rid, prompt, params, _ in reqs:
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def run_together(reqs, engine: LLMEngine) -> dict[str, list[int]]:
    pending = sorted(reqs, key=lambda r: r[3])
    out: dict[str, list[int]] = {}
    seen_tokens: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, params)
        res = engine.step()
        engine.check_invariants()
        for d in res.deltas:  # deltas are contiguous: no gap, no duplicate
            got = seen_tokens.setdefault(d.request_id, [])
            assert d.first_token_index == len(got)
            got.extend(d.token_ids)
        for o in res.finished:
            out[o.request_id] = o.outputs[0].token_ids
            assert seen_tokens[o.request_id] == o.outputs[0].token_ids
        step += 1
    return out


@pytest.fixture(scope="module")
def workload():
    reqs = _requests(64, seed=7, vocab=8192)  # enough to force preemption in each test below
    return reqs, run_alone(reqs)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_continuous_batching_chunked_prefill_preemption_exact(workload, block_size):
    reqs, alone = workload
    engine = LLMEngine(
        EngineConfig(
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            block_size=block_size,
            max_num_batched_tokens=32,
            max_num_seqs=16,
            num_kv_blocks=-(-640 // block_size),  # room for ~2 long requests: forces preemption
            skip_tokenizer_init=True,
        )
    )
    together = run_together(reqs, engine)
    assert engine.scheduler.num_preemptions > 0, "the workload did not force any preemption"
    assert set(together) == set(alone)
    mismatched = [rid for rid in alone if together[rid] != alone[rid]]
    assert not mismatched, f"{len(mismatched)} requests differ, e.g. {mismatched[:5]}"
    for rid, _, params, _ in reqs:
        assert len(together[rid]) == params.max_tokens
    engine.check_idle_invariants()


def test_without_chunked_prefill_exact(workload):
    reqs, alone = workload
    engine = LLMEngine(
        EngineConfig(
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=False,
            max_num_seqs=8,
            num_kv_blocks=48,
            skip_tokenizer_init=True,
        )
    )
    sub = reqs[:40]
    together = run_together(sub, engine)
    assert {rid: together[rid] for rid, *_ in sub} == {rid: alone[rid] for rid, *_ in sub}
    engine.check_idle_invariants()
