"""The draft model's catch-up goes through the token budget: a request the draft lags behind
(its prompt, after a preemption) is read by the draft in chunks of what the step's budget has
left, while the request decodes plainly; a proposal itself reads at most two unread tokens of a
request. Greedy output stays token-identical to plain decoding alone, both block pools empty at
the end; and a catch-up that fails for one request finishes that one with its error while the
others go on (the real default pair, float32)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from draftwise.worker import default_model_path
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.model.model_runner import SequenceChunk
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.speculative.decoder import MAX_INLINE_BACKLOG
from draftwise.worker.text.tokenizer import load_tokenizer

BUDGET = 48
TEXT = (
    "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n\n"
    "class Config:\n    def __init__(self, path):\n        self.path = path\n        self.values = {}\n"
)


def _engine(speculate: bool, **kw) -> LLMEngine:
    spec = dict(speculative_model="default", num_speculative_tokens=3, speculative_adaptive=False) if speculate else {}
    return LLMEngine(
        EngineConfig(
            dtype="float32",
            max_model_len=256,
            skip_tokenizer_init=True,
            max_num_batched_tokens=BUDGET,
            max_num_seqs=4,
            **{**spec, **kw},
        )
    )


def _prompts() -> list[list[int]]:
    ids = load_tokenizer(default_model_path("target")).encode(TEXT * 3)
    return [ids[:150], ids[10:130], ids[40:90], ids[5:25]]


def _plain_alone(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    engine = _engine(False)
    outs = []
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                outs.append(list(o.outputs[0].token_ids))
    return outs


class DraftCalls:
    """Records every draft forward pass: per step, the tokens of catch-up passes (no logits)
    and the largest per-request chunk of proposal passes."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.catch_up: dict[int, int] = defaultdict(int)
        self.proposal_chunk: dict[int, int] = defaultdict(int)
        runner = engine.spec.proposer.runner
        inner = runner.run

        def run(chunks: list[SequenceChunk]):
            step = engine.num_steps
            if all(c.num_logits == 0 for c in chunks):
                self.catch_up[step] += sum(len(c.token_ids) for c in chunks)
            else:
                self.proposal_chunk[step] = max(self.proposal_chunk[step], *(len(c.token_ids) for c in chunks))
            return inner(chunks)

        runner.run = run


def _run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, dict[int, int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    outs, batched = {}, {}
    while engine.has_unfinished_requests():
        step = engine.num_steps
        so = engine.step()
        batched[step] = so.stats.num_batched_tokens
        engine.check_invariants()
        for o in so.finished:
            outs[o.request_id] = o
    engine.check_idle_invariants()
    return outs, batched


def test_catch_up_is_chunked_within_the_budget_and_exact() -> None:
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _plain_alone(prompts, params)
    engine = _engine(True)
    calls = DraftCalls(engine)
    outs, batched = _run_all(engine, prompts, params)
    assert [list(outs[f"p{i}"].outputs[0].token_ids) for i in range(len(prompts))] == ref
    assert calls.catch_up, "the draft never caught up through the budget"
    for step, n in calls.catch_up.items():
        assert n <= BUDGET - batched[step], f"step {step}: catch-up of {n} tokens beside {batched[step]} scheduled"
    # the 150-token prompt cannot be read in one step's leftover budget: it took several
    assert sum(calls.catch_up.values()) >= sum(len(p) for p in prompts)
    assert len(calls.catch_up) >= 150 // BUDGET + 1
    assert max(calls.proposal_chunk.values()) <= MAX_INLINE_BACKLOG
    totals = engine.spec_totals
    assert totals["proposed"] > 0 and totals["accepted"] > 0


def test_catch_up_after_preemption_stays_exact() -> None:
    """A pool too small for all four requests: preempted requests lose their draft KV with
    their blocks and the draft catches up again, through the budget, when they come back."""
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ref = _plain_alone(prompts, params)
    engine = _engine(True, num_kv_blocks=24)
    calls = DraftCalls(engine)
    outs, batched = _run_all(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0, "the workload did not force a preemption"
    assert [list(outs[f"p{i}"].outputs[0].token_ids) for i in range(len(prompts))] == ref
    for step, n in calls.catch_up.items():
        assert n <= BUDGET - batched[step]
    assert max(calls.proposal_chunk.values()) <= MAX_INLINE_BACKLOG


def test_a_failing_catch_up_finishes_only_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _plain_alone(prompts, params)
    engine = _engine(True)
    proposer = engine.spec.proposer
    inner = proposer.catch_up

    def catch_up(reqs, ns):
        if any(r.request_id == "p1" for r in reqs):
            raise ValueError("draft cannot read p1")
        return inner(reqs, ns)

    monkeypatch.setattr(proposer, "catch_up", catch_up)
    outs, _ = _run_all(engine, prompts, params)
    assert outs["p1"].outputs[0].finish_reason == "error"
    assert "draft cannot read p1" in (outs["p1"].error or "")
    for i in (0, 2, 3):
        assert list(outs[f"p{i}"].outputs[0].token_ids) == ref[i]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_the_policy_decides_once_while_the_draft_catches_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the adaptive policy, the k it chose for a request the draft lags behind is kept
    until the draft has caught up (a probe after a pause is not lost to the catch-up), and the
    request drafts in the step right after the last catch-up chunk."""
    prompt = _prompts()[0]  # 150 tokens: 4 steps of catch-up within a budget of 48
    engine = _engine(True, speculative_adaptive=True)
    policy = engine.spec.policy
    calls = []
    inner = policy.choose_ks

    def choose_ks(states, batch_size, rooms=None):
        ks = inner(states, batch_size, rooms)
        calls.extend((engine.num_steps, k) for k in ks)  # one request: asked about it or not
        return ks

    monkeypatch.setattr(policy, "choose_ks", choose_ks)
    draft = DraftCalls(engine)
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    proposed_at = []
    while engine.has_unfinished_requests():
        step = engine.num_steps
        if engine.step().stats.num_spec_proposed:
            proposed_at.append(step)
    engine.check_idle_invariants()
    catch_up_steps = sorted(draft.catch_up)
    # the first catch-up: consecutive steps from the prompt on (the policy's cost layer, which reads measured step
    # times, may pause drafting later and the draft catch up again then: not what this test is about)
    first = [s for i, s in enumerate(catch_up_steps) if s == catch_up_steps[0] + i]
    assert len(first) >= 3, catch_up_steps
    assert proposed_at and proposed_at[0] == first[-1] + 1, (proposed_at, catch_up_steps)
    # asked once when the request fell behind, then not again until it drafted
    asked = [s for s, _ in calls if catch_up_steps[0] <= s <= proposed_at[0]]
    assert asked == [catch_up_steps[0]], calls
