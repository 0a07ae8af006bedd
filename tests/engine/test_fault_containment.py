"""Fault containment in the engine: an error that belongs to one request ends that request
with a clear error and leaves every other request running (and every block freed); only an
error that poisons the whole step stops the engine. Also the regressions of the defects
found in issue 10 that lived inside ``step()``: the mixed greedy + sampled batch under draft
speculation, and a draft with a smaller vocabulary than the target plus a penalty."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftwise.worker import LLM, SamplingParams, default_model_path
from draftwise.worker.engine.llm_engine import EngineDeadError, LLMEngine, is_step_fatal

SMALL = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 96, "max_num_seqs": 16}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _drain(engine: LLMEngine, limit: int = 2000) -> dict:
    outs = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        out = engine.step()
        engine.check_invariants()
        for o in out.finished:
            outs[o.request_id] = o
    assert not engine.has_unfinished_requests()
    return outs


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(speculative_model="default", num_speculative_tokens=4, speculative_adaptive=False, **SMALL)


@pytest.fixture(scope="module")
def plain_llm():
    return LLM(**SMALL)


# ---------------------------------------------------------------- defect 1


def test_mixed_greedy_and_sampled_batch_under_draft_speculation(spec_llm, plain_llm):
    """Issue 10, defect 1: one greedy request (64 tokens) and one sampled request (4 tokens)
    in one generate call crashed the draft proposer ("a sampling batch must have q for every
    drafted position") once the rows still drafting were all greedy."""
    prompts = ["def fibonacci(n):", "import os\n"]
    params = [
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=4, seed=7, ignore_eos=True),
    ]
    outs = spec_llm.generate(prompts, params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 64 and len(outs[1].outputs[0].token_ids) == 4
    assert outs[0].outputs[0].num_spec_proposed > 0  # it did speculate alongside the sampled row
    alone = plain_llm.generate(prompts[0], params[0], use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids  # speculation stays exact
    spec_llm.engine.check_idle_invariants()


def test_many_mixed_batches_under_draft_speculation(spec_llm):
    """Greedy and sampled rows of many lengths, with and without penalties, arriving together:
    the drafting rows change kind from step to step."""
    prompts, params = [], []
    for i in range(12):
        prompts.append(f"# case {i}\ndef f{i}(x):")
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.8, max_tokens=2 + i, seed=i, ignore_eos=True))
        else:
            params.append(
                SamplingParams(temperature=0, max_tokens=3 + i, repetition_penalty=1.3, min_tokens=2, ignore_eos=True)
            )
    outs = spec_llm.generate(prompts, params, use_tqdm=False)
    for o, p in zip(outs, params, strict=True):
        assert len(o.outputs[0].token_ids) == p.max_tokens
    spec_llm.engine.check_idle_invariants()


# ---------------------------------------------------------------- defect 4


@pytest.fixture(scope="module")
def small_vocab_draft(tmp_path_factory) -> Path:
    """The embedded draft cut down to the first 4096 entries of the vocabulary (a draft with a
    smaller, unpadded vocabulary than the target's 8192, as the engine allows)."""
    src = default_model_path("draft")
    dst = tmp_path_factory.mktemp("small-vocab-draft")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["vocab_size"] = 4096
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:4096].contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=12, frequency_penalty=0.5, presence_penalty=0.2, seed=3),
    ],
    ids=["greedy-repetition", "sampled-frequency-presence"],
)
def test_smaller_draft_vocabulary_with_penalties_and_high_prompt_ids(small_vocab_draft, params):
    """Issue 10, defect 4: a penalty over a prompt token id beyond the draft's vocabulary
    raised inside step() and killed the engine."""
    llm = LLM(speculative_model=str(small_vocab_draft), num_speculative_tokens=3, speculative_adaptive=False, **SMALL)
    prompt = [1, 536, 887, 8000, 8191, 6000, 4096, 4095, 536, 887]  # ids at and beyond the draft's 4096
    out = llm.generate([prompt, "def f(x):"], params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason in ("length", "stop") for o in out)
    assert all(len(o.outputs[0].token_ids) > 0 for o in out)
    if params.is_greedy:
        plain = LLM(**SMALL).generate([prompt], params, use_tqdm=False)[0]
        assert out[0].outputs[0].token_ids == plain.outputs[0].token_ids
    llm.engine.check_idle_invariants()


def test_smaller_draft_vocabulary_check_reads_only_new_tokens(small_vocab_draft):
    """Whether the draft can read a request is checked over the tokens appended since the
    last check, not the whole context every step; an id beyond the draft's vocabulary that
    arrives later still turns speculation off for that request."""
    llm = LLM(speculative_model=str(small_vocab_draft), num_speculative_tokens=3, **SMALL)
    eng = llm.engine
    proposer = eng.proposer
    eng.add_request("a", [1, 536, 887, 536, 887], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    req = eng.requests["a"]
    eng.step()
    assert proposer.can_draft(req) and proposer.kv["a"].vocab_checked == req.num_tokens
    checked = proposer.kv["a"].vocab_checked
    req.output_token_ids.append(7)  # a token inside the draft's vocabulary: only it is read
    assert proposer.can_draft(req) and proposer.kv["a"].vocab_checked == checked + 1
    req.output_token_ids.append(5000)  # beyond the draft's 4096 entries
    assert not proposer.can_draft(req)
    eng.abort_request("a")
    eng.step()
    eng.check_idle_invariants()


# ---------------------------------------------------------------- containment


def test_a_failing_detokenizer_ends_only_its_request(plain_llm):
    engine = plain_llm.engine
    for i in range(4):
        engine.add_request(f"ok{i}", f"def g{i}(x):", GREEDY)
    bad = engine.add_request("bad", "def broken(x):", GREEDY)

    def explode(_tokens):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected: a detokenizer that cannot decode")

    engine.output.detokenizers[bad.request_id].add_tokens = explode
    outs = _drain(engine)
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert "injected" in outs["bad"].error
    for i in range(4):
        assert outs[f"ok{i}"].outputs[0].finish_reason == "length"
        assert len(outs[f"ok{i}"].outputs[0].token_ids) == GREEDY.max_tokens
        assert outs[f"ok{i}"].error is None
    engine.check_idle_invariants()


def test_a_failing_proposal_ends_only_its_request(spec_llm):
    engine = spec_llm.engine
    proposer = engine.proposer
    for i in range(3):
        engine.add_request(f"ok{i}", f"def h{i}(x):", GREEDY)
    engine.add_request("bad", "def broken(x):", GREEDY)
    original = proposer.propose

    def propose(reqs, ks):
        if any(r.request_id == "bad" for r in reqs):
            raise IndexError("injected: the proposer fails on this request's rows")
        return original(reqs, ks)

    proposer.propose = propose
    try:
        outs = _drain(engine)
    finally:
        del proposer.propose
    assert outs["bad"].outputs[0].finish_reason == "error" and "injected" in outs["bad"].error
    alone = spec_llm.generate([f"def h{i}(x):" for i in range(3)], GREEDY, use_tqdm=False)
    for i in range(3):
        assert outs[f"ok{i}"].outputs[0].token_ids == alone[i].outputs[0].token_ids
        assert outs[f"ok{i}"].outputs[0].num_spec_proposed > 0
    engine.check_idle_invariants()


@pytest.mark.parametrize("phase", ["plan", "verify"])
def test_a_failing_plan_or_verification_ends_only_its_request(spec_llm, phase):
    """The speculation phases besides proposing: planning (the proposer's ``plan``, e.g. an
    n-gram lookup) and verification (rejection sampling) fail for one request's rows; that
    request ends with its error, the others go on exactly and every block is freed."""
    engine = spec_llm.engine
    spec = engine.spec
    for i in range(3):
        engine.add_request(f"ok{i}", f"def h{i}(x):", GREEDY)
    engine.add_request("bad", "def broken(x):", GREEDY)
    target, name = (spec.proposer, "plan") if phase == "plan" else (spec, "_verify_batch")
    original = getattr(target, name)

    def plan(req, k):
        if req.request_id == "bad":
            raise IndexError("injected: planning fails for this request")
        return original(req, k)

    def verify(logits, items):
        if any(s.request.request_id == "bad" for s, _ in items):
            raise IndexError("injected: verification fails on this request's rows")
        return original(logits, items)

    setattr(target, name, plan if phase == "plan" else verify)
    try:
        outs = _drain(engine)
    finally:
        delattr(target, name)
    assert outs["bad"].outputs[0].finish_reason == "error" and "injected" in outs["bad"].error
    alone = spec_llm.generate([f"def h{i}(x):" for i in range(3)], GREEDY, use_tqdm=False)
    for i in range(3):
        assert outs[f"ok{i}"].outputs[0].token_ids == alone[i].outputs[0].token_ids
        assert outs[f"ok{i}"].outputs[0].num_spec_proposed > 0
    engine.check_idle_invariants()


def test_a_forward_error_of_one_sequence_ends_only_its_request(plain_llm):
    engine = plain_llm.engine
    runner = engine.runner
    for i in range(3):
        engine.add_request(f"ok{i}", f"def k{i}(x):", GREEDY)
    bad = engine.add_request("bad", "def broken(x):", GREEDY)
    original = runner.run

    def run(chunks):
        if any(c.block_table is bad.block_table for c in chunks):
            raise ValueError("injected: a bad sequence in the forward pass")
        return original(chunks)

    runner.run = run
    try:
        outs = _drain(engine)
    finally:
        del runner.run
    assert outs["bad"].outputs[0].finish_reason == "error"
    alone = plain_llm.generate([f"def k{i}(x):" for i in range(3)], GREEDY, use_tqdm=False)
    for i in range(3):
        assert outs[f"ok{i}"].outputs[0].token_ids == alone[i].outputs[0].token_ids
    engine.check_idle_invariants()


def test_a_failing_sampler_row_ends_only_its_request(plain_llm):
    engine = plain_llm.engine
    sampler = engine.sampler
    for i in range(3):
        engine.add_request(f"ok{i}", f"def m{i}(x):", GREEDY)
    engine.add_request("bad", "def broken(x):", SamplingParams(temperature=0.5, max_tokens=24, seed=1))
    original = sampler.__call__

    class Failing(type(sampler)):
        def __call__(self, logits, rows):
            if any(not r.params.is_greedy for r in rows):
                raise RuntimeError("injected: sampling this row fails")
            return original(logits, rows)

    sampler.__class__ = Failing
    try:
        outs = _drain(engine)
    finally:
        sampler.__class__ = Failing.__mro__[1]
    assert outs["bad"].outputs[0].finish_reason == "error"
    for i in range(3):
        assert len(outs[f"ok{i}"].outputs[0].token_ids) == GREEDY.max_tokens
    engine.check_idle_invariants()


def test_step_wide_errors_are_fatal():
    assert is_step_fatal(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_step_fatal(MemoryError())
    assert is_step_fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_step_fatal(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_step_fatal(ValueError("bad request state"))
    assert not is_step_fatal(IndexError("index 8191 is out of bounds for dimension 1 with size 4096"))


def test_an_out_of_memory_step_stops_the_engine(plain_llm):
    """A step-wide failure is not blamed on a request: step() raises EngineDeadError and the
    engine refuses further work."""
    engine = LLMEngine(plain_llm.engine.config)
    engine.add_request("a", "def f(x):", GREEDY)
    engine.add_request("b", "def g(x):", GREEDY)

    def run(_chunks):
        raise torch.OutOfMemoryError("injected: out of memory")

    engine.runner.run = run
    with pytest.raises(EngineDeadError, match="out of memory"):
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.add_request("c", "def h(x):", GREEDY)
