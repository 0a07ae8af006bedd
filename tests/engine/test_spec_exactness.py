"""Speculative decoding changes nothing in greedy output: with the draft model and with
n-gram lookup, for k in {1, 3, 5, 8}, under continuous batching, chunked prefill and forced
preemption, every request produces token for token what plain greedy decoding produces
alone; drafts are both accepted and rejected along the way, and both block pools (target
and draft) are empty once the engine is idle."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from draftwise.worker import default_model_path
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.text.tokenizer import load_tokenizer

MAX_MODEL_LEN = 512
REPO = Path(__file__).resolve().parents[2]


def _code_ids() -> list[int]:
    """Token ids of real Python source (this repository's engine), for realistic prompts."""
    tok = load_tokenizer(default_model_path("target"))
    text = "".join(
        (REPO / "worker" / name).read_text()
        for name in ("engine/llm_engine.py", "core/scheduler.py", "sampling/sampler.py")
    )
    return tok.encode(text)


def _requests(n: int, seed: int) -> list[tuple[str, list[int], SamplingParams, int]]:
    """(id, prompt ids, params, arrival step): slices of real code, random tokens, and a
    random segment repeated (which n-gram lookup finds)."""
    rng = random.Random(seed)
    code = _code_ids()
    out = []
    for i in range(n):
        kind = rng.choice(["code", "code", "random", "repeat"])
        plen = rng.choice([1, 2, rng.randint(1, 40), rng.randint(1, 300), rng.randint(200, 300)])
        if kind == "code":
            start = rng.randrange(len(code) - plen)
            prompt = code[start : start + plen]
        elif kind == "random":
            prompt = [1] + [rng.randrange(3, 8192) for _ in range(plen - 1)]
        else:
            seg = [rng.randrange(3, 8192) for _ in range(rng.randint(2, 12))]
            prompt = (seg * (plen // len(seg) + 1))[:plen]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True)
        out.append((f"r{i}", prompt, params, rng.randint(0, 40)))
    return out


def _config(**kw) -> EngineConfig:
    return EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, skip_tokenizer_init=True, **kw)


def run_alone(reqs, **config) -> dict[str, list[int]]:
    """Each request's tokens with no other request in the engine (``config``: more EngineConfig fields)."""
    engine = LLMEngine(_config(num_kv_blocks=64, **config))
    out = {}
    for rid, prompt, params, _ in reqs:
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def run_together(reqs, engine: LLMEngine, finals: dict | None = None) -> dict[str, list[int]]:
    pending = sorted(reqs, key=lambda r: r[3])
    out: dict[str, list[int]] = {}
    seen: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, params)
        res = engine.step()
        engine.check_invariants()
        for d in res.deltas:  # contiguous deltas, several tokens at a time
            got = seen.setdefault(d.request_id, [])
            assert d.first_token_index == len(got)
            got.extend(d.token_ids)
        for o in res.finished:
            out[o.request_id] = o.outputs[0].token_ids
            assert seen[o.request_id] == o.outputs[0].token_ids
            if finals is not None:
                finals[o.request_id] = o
        step += 1
    return out


@pytest.fixture(scope="module")
def workload():
    reqs = _requests(56, seed=11)  # 56: enough to force preemption in every configuration below
    return reqs, run_alone(reqs)


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_greedy_is_exact(workload, method, k):
    reqs, alone = workload
    spec = {"speculative_model": "default"} if method == "draft" else {"speculative_method": "ngram"}
    engine = LLMEngine(
        _config(
            block_size=16,
            max_num_batched_tokens=48,
            max_num_seqs=12,
            num_kv_blocks=40,  # 640 tokens: forces preemption
            num_speculative_tokens=k,
            speculative_adaptive=False,
            **spec,
        )
    )
    together = run_together(reqs, engine)
    assert engine.scheduler.num_preemptions > 0, "the workload did not force any preemption"
    mismatched = [rid for rid in alone if together[rid] != alone[rid]]
    assert not mismatched, f"{len(mismatched)} requests differ, e.g. {mismatched[:5]}"
    totals = engine.spec_totals
    assert totals["verify_steps"] > 0
    assert 0 < totals["accepted"] < totals["proposed"], totals  # both accepts and rejects happened
    if k > 1:
        # some round verified k drafts at once (n-gram only proposes what it finds)
        assert totals["proposed"] > totals["verify_steps"]
    engine.check_idle_invariants()


def test_adaptive_policy_is_exact_and_mixed_with_plain_requests(workload):
    """The adaptive policy (k varying per request and step) and requests that opt out or cap k."""
    reqs, alone = workload
    engine = LLMEngine(
        _config(
            block_size=32,
            max_num_batched_tokens=40,
            max_num_seqs=10,
            num_kv_blocks=20,
            speculative_model="default",
            num_speculative_tokens=6,
        )
    )
    varied = []
    for i, (rid, prompt, params, arrival) in enumerate(reqs):
        if i % 3 == 1:
            params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True, use_speculation=False)
        elif i % 3 == 2:
            params = SamplingParams(
                temperature=0, max_tokens=params.max_tokens, ignore_eos=True, max_speculative_tokens=2
            )
        varied.append((rid, prompt, params, arrival))
    finals: dict = {}
    together = run_together(varied, engine, finals)
    assert together == alone
    assert engine.spec_totals["proposed"] > 0
    for i, (rid, *_rest) in enumerate(varied):
        c = finals[rid].outputs[0]
        if i % 3 == 1:  # opted out
            assert c.spec is None and c.num_spec_proposed == 0 and c.spec_token_acceptance_rate is None
        elif i % 3 == 2 and c.spec is not None and c.spec.verify_steps:  # capped at 2 per round
            assert c.num_spec_proposed <= 2 * c.spec.verify_steps
    speculated = [finals[rid].outputs[0] for rid, *_ in varied if finals[rid].outputs[0].num_spec_proposed]
    assert speculated
    for c in speculated:
        assert c.spec_token_acceptance_rate == c.num_spec_accepted / c.num_spec_proposed
        assert c.spec_mean_accepted_length == 1 + c.num_spec_accepted / c.spec.verify_steps
    engine.check_idle_invariants()


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_logprobs_under_speculation_equal_plain(method):
    """Greedy requests that ask for logprobs: a verified round reports the target's logprobs at every token it
    keeps, as plain decoding does (an all-greedy verify batch takes its own path, from the sampler's greedy
    tokens). The worker keeps serving and ends idle."""
    reqs = [
        (rid, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2), at)
        for rid, prompt, _, at in _requests(8, seed=5)
    ]

    def run(**spec) -> tuple[dict, LLMEngine]:
        engine = LLMEngine(_config(num_kv_blocks=96, **spec))
        finals: dict = {}
        run_together(reqs, engine, finals)
        engine.check_idle_invariants()
        return finals, engine

    plain, _ = run()
    spec = {"speculative_model": "default"} if method == "draft" else {"speculative_method": "ngram"}
    got, engine = run(num_speculative_tokens=3, speculative_adaptive=False, **spec)
    assert engine.spec_totals["verify_steps"] > 0 and engine.spec_totals["accepted"] > 0, engine.spec_totals
    for rid, want in plain.items():
        w, g = want.outputs[0], got[rid].outputs[0]
        assert g.token_ids == w.token_ids, rid
        assert g.logprobs is not None and len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a is not None and b is not None and (a.token_id, a.rank) == (b.token_id, b.rank)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
