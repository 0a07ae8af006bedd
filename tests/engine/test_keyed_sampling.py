"""A seeded sampled request gives the same tokens (a) alone, (b) in a batch of 32 other
requests (greedy, seeded, unseeded, different lengths, chunked prefill), (c) with speculation
on (the embedded draft model and n-gram lookup, k = 1, 3, 5 and the adaptive policy), and (d)
when restarted midway: a new request whose prompt is the prompt plus the first m tokens goes
on with exactly the tokens the undisturbed run produced (the randomness of the token at
position t is keyed by (seed, t), and t counts prompt and output alike). Real engine, the
embedded default target and draft, the real tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.sampling.sampling_params import SamplingParams

# Repetitive code: n-gram lookup finds matches, and the draft model agrees often enough.
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
N = 32
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=4242, max_tokens=N, ignore_eos=True)
BASE = dict(dtype="float32", max_model_len=512, num_kv_blocks=256, max_num_seqs=64)


def _engine(**kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**BASE, **kw}))


def _run(engine: LLMEngine, requests: list[tuple[str, str | list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        for d in engine.step().deltas:
            assert d.first_token_index == len(out[d.request_id])
            out[d.request_id] += d.token_ids
    engine.check_idle_invariants()
    return out


@pytest.fixture(scope="module")
def plain() -> Iterator[LLMEngine]:
    yield _engine()


@pytest.fixture(scope="module")
def alone(plain: LLMEngine) -> list[int]:
    """(a) The reference: the seeded request alone, no speculation."""
    tokens = _run(plain, [("alone", PROMPT, SEEDED)])["alone"]
    assert len(tokens) == N and len(set(tokens)) > 8  # a real sampled sequence
    return tokens


def test_alone_is_reproducible_and_the_seed_matters(plain: LLMEngine, alone: list[int]) -> None:
    assert _run(plain, [("again", PROMPT, SEEDED)])["again"] == alone
    other = SamplingParams(temperature=0.8, top_p=0.95, seed=4243, max_tokens=N, ignore_eos=True)
    assert _run(plain, [("other", PROMPT, other)])["other"] != alone
    unseeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=N, ignore_eos=True)
    assert _run(plain, [("u", PROMPT, unseeded)])["u"] != alone


def _others(n: int) -> list[tuple[str, str, SamplingParams]]:
    """n requests: greedy, seeded and unseeded sampled, with penalties, prompts and outputs of
    different lengths."""
    reqs = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(temperature=1.0, seed=i, max_tokens=3 + i, ignore_eos=True)
        elif kind == 2:
            params = SamplingParams(temperature=0.7, top_k=20, max_tokens=N, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.9, repetition_penalty=1.2, max_tokens=1 + i, ignore_eos=True)
        reqs.append((f"o{i}", "import os\n" * (1 + i % 7) + f"x{i} = ", params))
    return reqs


def test_the_same_in_a_batch_of_32(alone: list[int]) -> None:
    # a small token budget: the seeded request's prompt is prefilled in chunks among the others
    engine = _engine(max_num_batched_tokens=64)
    others = _others(32)
    reqs = [*others[:13], ("me", PROMPT, SEEDED), *others[13:]]
    out = _run(engine, reqs)
    assert out["me"] == alone
    assert len({len(t) for t in out.values()}) > 10


SPEC = {
    "draft-k1": dict(speculative_model="default", num_speculative_tokens=1, speculative_adaptive=False),
    "draft-k3": dict(speculative_model="default", num_speculative_tokens=3, speculative_adaptive=False),
    "draft-k5": dict(speculative_model="default", num_speculative_tokens=5, speculative_adaptive=False),
    "draft-adaptive": dict(speculative_model="default", num_speculative_tokens=5, speculative_adaptive=True),
    "ngram-k1": dict(speculative_method="ngram", num_speculative_tokens=1, speculative_adaptive=False),
    "ngram-k3": dict(speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False),
    "ngram-k5": dict(speculative_method="ngram", num_speculative_tokens=5, speculative_adaptive=False),
    "ngram-adaptive": dict(speculative_method="ngram", num_speculative_tokens=5, speculative_adaptive=True),
}


@pytest.mark.parametrize("spec", list(SPEC))
def test_the_same_with_speculation(alone: list[int], spec: str) -> None:
    engine = _engine(**SPEC[spec])
    reqs = [("me", PROMPT, SEEDED)]
    if spec in ("draft-k3", "ngram-k3"):  # in a batch too: other requests speculate beside it
        reqs = [*_others(6), *reqs]
    out = _run(engine, reqs)
    assert out["me"] == alone, spec
    totals = engine.spec_totals
    assert totals["proposed"] > 0, totals  # speculation did run
    if spec.startswith("draft") and not spec.endswith("adaptive"):  # (the policy's k follows measured timings)
        assert 0 < totals["accepted"] < totals["proposed"], totals  # accepts and rejections both


@pytest.mark.parametrize("m", [1, 17, 29])
def test_restarted_midway_goes_on_with_the_same_tokens(plain: LLMEngine, alone: list[int], m: int) -> None:
    """Prompt + the first m tokens as a new request's prompt (no penalties, so output tokens
    and prompt tokens weigh alike): the same absolute positions draw the same numbers."""
    assert plain.tokenizer is not None
    ids = plain.tokenizer.encode(PROMPT)
    rest = SamplingParams(temperature=0.8, top_p=0.95, seed=4242, max_tokens=N - m, ignore_eos=True)
    assert _run(plain, [(f"resumed{m}", ids + alone[:m], rest)])[f"resumed{m}"] == alone[m:]


def test_restarted_midway_on_a_speculating_engine(alone: list[int]) -> None:
    engine = _engine(speculative_model="default", num_speculative_tokens=4, speculative_adaptive=True)
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(PROMPT)
    m = 21
    rest = SamplingParams(temperature=0.8, top_p=0.95, seed=4242, max_tokens=N - m, ignore_eos=True)
    assert _run(engine, [("resumed", ids + alone[:m], rest)])["resumed"] == alone[m:]
    assert engine.spec_totals["proposed"] > 0


@pytest.mark.parametrize("m", [1, 17, 29])
def test_after_a_failover_with_its_continuation(plain: LLMEngine, alone: list[int], m: int) -> None:
    """What the gateway does on failover: the same request (same prompt, same params) with the
    m tokens already sent as its continuation, in a batch with others, on a speculating engine
    too: the rest is exactly the undisturbed run's."""
    for engine in (plain, _engine(speculative_model="default", num_speculative_tokens=3, speculative_adaptive=False)):
        engine.add_request(f"failover{m}", PROMPT, SEEDED, continuation=alone[:m])
        for rid, prompt, params in _others(8):
            engine.add_request(f"{rid}-{m}", prompt, params)
        got: list[int] = []
        while engine.has_unfinished_requests():
            for d in engine.step().deltas:
                if d.request_id == f"failover{m}":
                    assert d.first_token_index == m + len(got)
                    got += d.token_ids
        engine.check_idle_invariants()
        assert got == alone[m:]
