"""One speculating engine, one batch of every kind of request: greedy, seeded-sampled and
unseeded-sampled, each with its own cap on k (speculation off for some), under chunked
prefill (a small token budget) and preemption (a small KV pool), for both proposers.

Greedy rows must equal the plain engine's greedy output alone, token for token; seeded rows
must equal the same request alone on the plain engine (randomness keyed by seed and position,
seeded verification by Gumbel coupling); unseeded rows must be well-formed. Afterwards no
block and no per-request state is left anywhere (the SpecDecoder's, the proposer's, the
OutputProcessor's). Real engine, the embedded default target and draft, the real tokenizer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.sampling.sampling_params import SamplingParams

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
PROMPTS = [
    CODE,
    "import os\nimport sys\n\n\ndef main():\n    " * 3,
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\n",
]
N = 24
BASE = dict(dtype="float32", max_model_len=512, max_num_seqs=16)


def _params(i: int) -> SamplingParams:
    """Request i: kind by i % 3, its own cap on k (0: no speculation) by i % 4."""
    cap = [None, 1, 3, 0][i % 4]
    spec = dict(use_speculation=cap != 0, max_speculative_tokens=cap or None)
    if i % 3 == 0:
        return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, **spec)
    if i % 3 == 1:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=N, ignore_eos=True, **spec)
    return SamplingParams(temperature=1.0, top_k=50, max_tokens=N, ignore_eos=True, **spec)


REQUESTS = [(f"r{i}", PROMPTS[i % len(PROMPTS)] + f"# {i}\n", _params(i)) for i in range(12)]


def _run(engine: LLMEngine, requests) -> dict[str, list[int]]:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        step = engine.step()
        engine.check_invariants()
        for d in step.deltas:
            assert d.first_token_index == len(out[d.request_id]), d
            out[d.request_id] += d.token_ids
    engine.check_idle_invariants()
    return out


@pytest.fixture(scope="module")
def alone() -> dict[str, list[int]]:
    """Greedy and seeded requests, each alone on a plain engine."""
    plain = LLMEngine(EngineConfig(**BASE))
    out = {}
    for rid, prompt, params in REQUESTS:
        if params.is_greedy or params.seed is not None:
            out.update(_run(plain, [(rid, prompt, params)]))
    return out


@pytest.fixture(scope="module", params=["draft", "ngram"])
def mixed(request) -> Iterator[tuple[LLMEngine, dict[str, list[int]]]]:
    spec = {"draft": dict(speculative_model="default"), "ngram": dict(speculative_method="ngram")}[request.param]
    # 20 blocks of 16 tokens (320) for 12 requests of 55-65 tokens each: preemption; 64 tokens a step: chunking
    engine = LLMEngine(
        EngineConfig(
            **{**BASE, "max_model_len": 256},
            num_kv_blocks=20,
            max_num_batched_tokens=64,
            num_speculative_tokens=5,
            **spec,
        )
    )
    preempted_before = engine.scheduler.num_preemptions
    out = _run(engine, REQUESTS)
    assert engine.scheduler.num_preemptions > preempted_before, "the workload must preempt"
    yield engine, out


def test_greedy_rows_equal_plain_alone(mixed, alone) -> None:
    _, out = mixed
    for rid, _, params in REQUESTS:
        if params.is_greedy:
            assert out[rid] == alone[rid], rid


def test_seeded_rows_equal_the_same_request_alone(mixed, alone) -> None:
    _, out = mixed
    for rid, _, params in REQUESTS:
        if not params.is_greedy and params.seed is not None:
            assert out[rid] == alone[rid], rid


def test_unseeded_rows_are_complete_and_speculation_ran(mixed) -> None:
    engine, out = mixed
    assert all(len(toks) == N for toks in out.values())
    assert engine.spec_totals["proposed"] > 0 and engine.spec_totals["verify_steps"] > 0


def test_acceptance_counts_only_tokens_that_reach_the_output() -> None:
    """A stop token inside an accepted run of drafts ends the request there: the drafts after
    it were accepted by the verifier but never reach the output, and are not counted."""
    engine = LLMEngine(
        EngineConfig(**BASE, speculative_model="default", num_speculative_tokens=4, speculative_adaptive=False)
    )
    greedy = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("free", CODE, SamplingParams(**greedy))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step().deltas
    tokens = [t for d in deltas for t in d.token_ids]
    # a token that first occurs inside a round, not as its last token: accepted drafts follow it
    inside = [
        d.first_token_index + j
        for d in deltas
        for j in range(len(d.token_ids) - 1)
        if tokens.index(d.token_ids[j]) == d.first_token_index + j
    ]
    assert inside, "the draft must have accepted runs on this text"
    cut = inside[0]
    engine.add_request("stopped", CODE, SamplingParams(**greedy, stop_token_ids=[tokens[cut]]))
    final = None
    while engine.has_unfinished_requests():
        for d in engine.step().deltas:
            final = d.final or final
    assert final is not None
    out = final.outputs[0]
    assert out.token_ids == tokens[: cut + 1] and out.finish_reason == "stop"
    # every delta whose step verified drafts (k = 4 always; the first decode step is plain while
    # the draft catches up on the prompt) is one round: its accepted drafts are all its tokens but
    # the last; in the round the stop cuts, only those up to the stop token reached the output
    rounds, seen = [], 0
    for d in deltas:
        steps = d.spec.verify_steps if d.spec is not None else 0
        if steps > seen and d.first_token_index <= cut:
            rounds.append(d)
        seen = steps
    assert rounds and deltas[1].spec is not None and deltas[1].spec.verify_steps == 0  # the catch-up step
    last = rounds[-1]
    want = sum(len(d.token_ids) - 1 for d in rounds[:-1]) + (cut - last.first_token_index + 1)
    assert len(last.token_ids) - 1 > cut - last.first_token_index + 1  # drafts were accepted past the stop
    assert out.spec is not None and out.spec.verify_steps == len(rounds)
    assert out.spec.accepted == want, (out.spec, want)
    engine.check_idle_invariants()
