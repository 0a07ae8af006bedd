"""The speculation policy in a real engine at batch 1 (n-gram lookup, the embedded default
model): once the costs of plain and verify steps are measured, a request on repetitive text
keeps speculating (the cost model once extrapolated in proportion from one measured size and
switched speculation off for good after the first draft), while a request whose drafts are
all rejected stops within a few rounds and is only probed now and then."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from draftwise.worker import default_model_path
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.text.tokenizer import load_tokenizer

REPETITIVE = "x = [1, 2, 3]\n" * 6


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a loaded 2-core machine two threads wait on each other at every
    op and step times stop reflecting the work (the policy would rightly stop speculating)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", max_model_len=512, skip_tokenizer_init=True, num_kv_blocks=64, **kw))


def _run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], list]:
    """Output token ids and per-step (proposed, accepted, request off) of one request alone."""
    engine.add_request(rid, prompt, params)
    steps, out = [], []
    while engine.has_unfinished_requests():
        so = engine.step()
        sr = engine.spec.requests.get(rid) if engine.spec is not None else None
        steps.append(
            (so.stats.num_spec_proposed, so.stats.num_spec_accepted, sr is not None and sr.policy.off_steps is not None)
        )
        for o in so.finished:
            out = list(o.outputs[0].token_ids)
    return out, steps


def _steady_costs(engine: LLMEngine) -> None:
    """Target step times from a fixed cost curve (10 ms plus 0.5 ms a token) instead of the clock: the
    cost model still learns each step size from what it records and extrapolates as it does from the
    clock, but on a machine loaded by a full test run measured verify steps once looked too dear and
    the policy rightly stopped drafting (12 plain steps in the tail: the test failed, and passed alone)."""
    spec = engine.spec
    assert spec is not None
    costs = spec.policy.costs
    spec.record_target_step = lambda n, _seconds: costs.record_target(n, 0.010 + 0.0005 * n)  # type: ignore[method-assign]


def test_repetitive_text_keeps_speculating_at_batch1(one_thread):
    ids = load_tokenizer(default_model_path("target")).encode(REPETITIVE)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    plain, _ = _run(_engine(), "plain", ids, params)
    engine = _engine(speculative_method="ngram")
    _steady_costs(engine)
    _run(engine, "warm-up", ids, params)  # costs of plain and verify steps measured
    sizes = sorted(engine.spec.policy.costs._verify)
    assert 1 in sizes and any(s > 1 for s in sizes), sizes
    out, steps = _run(engine, "r", ids, params)
    assert out == plain  # greedy: speculation changes nothing
    proposed = sum(p for p, _, _ in steps)
    accepted = sum(a for _, a, _ in steps)
    # early on the output has not fallen into the pattern yet and lookup finds nothing to
    # copy; once it has, every step must speculate (the defect: one draft, then none at all)
    # but for the plain step the policy times every 64 steps
    tail = steps[-len(steps) * 2 // 5 : -1]
    assert sum(1 for p, _, _ in tail if p == 0) <= 1, [(p, a) for p, a, _ in steps]
    assert accepted >= 0.8 * proposed and accepted >= len(out) // 3, (proposed, accepted, len(out))
    assert len(steps) < 0.75 * len(out)  # fewer steps than tokens: speculation paid its way


def test_always_rejected_drafts_stop_quickly(one_thread):
    """A frequency penalty makes the target avoid repeating its own output, which is what
    n-gram lookup proposes: (nearly) every drafted token is rejected. After three empty rounds
    the request stops drafting; then only a one-token probe after probe_after (8) or more plain steps
    (a probe that happens to be accepted restarts it at k = 1, gently)."""
    ids = load_tokenizer(default_model_path("target")).encode(REPETITIVE)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, frequency_penalty=2.0)
    plain, _ = _run(_engine(), "plain", ids, params)
    fixed = _engine(speculative_method="ngram", speculative_adaptive=False)
    _, fixed_steps = _run(fixed, "fixed", ids, params)
    engine = _engine(speculative_method="ngram")
    out, steps = _run(engine, "r", ids, params)
    assert out == plain
    rounds = [(p, a) for p, a, _ in steps if p]
    drafted, accepted = sum(p for p, _ in rounds), sum(a for _, a in rounds)
    assert rounds[:3] == [(p, 0) for p, _ in rounds[:3]], rounds  # the premise: the first rounds fail
    assert accepted <= 0.25 * drafted, rounds  # and nearly every later draft too
    first_off = next(i for i, (_, _, off) in enumerate(steps) if off)
    assert sum(1 for p, _, _ in steps[: first_off + 1] if p) == 3  # off after three empty rounds
    after = steps[first_off + 1 :]
    later = [p for p, _, _ in after if p]
    assert all(p == 1 for p in later), later  # probes draft one token, and a lucky one restarts at k = 1
    assert len(later) <= len(after) // 6, (len(later), len(after))
    fixed_drafted = sum(p for p, _, _ in fixed_steps)
    assert drafted < fixed_drafted / 2, (rounds, fixed_drafted)  # far fewer wasted drafts
