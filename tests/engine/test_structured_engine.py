"""Constrained decoding in the engine (worker/sampling/grammar.py, worker/engine/constrain.py), on the
embedded default model and its real tokenizer.

- Exactness under speculation: constrained greedy output with each proposer (draft model, n-gram,
  suffix, EAGLE, Medusa) equals constrained greedy output without speculation, batched, with chunked
  prefill and preemption; seeded sampled output equals plain seeded output.
- The sampled distribution: unseeded sampling under a choice constraint, with and without
  speculation (rejection sampling with the draft model's q, and n-gram's one-hot q), follows the
  masked target distribution, computed exactly with transformers (an independent implementation)
  and xgrammar's matcher over every allowed token path; a chi-square test at p < 1e-3.
- Errors: every way a constraint is refused (invalid schema, unsupported keyword, a regex or grammar
  that does not parse, one that matches nothing, a continuation that breaks it, no tokenizer) is a
  ValueError that touches nothing; a matcher that fails mid-request fails that request alone, its
  blocks freed.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from scipy.stats import chisquare

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.paths import default_model_path
from draftwise.worker.sampling.constraints import Constraint
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.text.tokenizer import load_tokenizer
from tests.engine.test_spec_exactness import run_together

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    Constraint.json_schema(SCHEMA),
    Constraint.json_object(),
    Constraint.regex(r"(yes|no), [0-9]{1,3} (apples|pears)"),
    Constraint.choice(["alpha", "beta gamma", "delta"]),
    Constraint.grammar('root ::= "def " [a-z]{1,6} "(" [a-z]{0,4} "):"'),
]
PROMPTS = [
    "def fibonacci(n):",
    "The answer, as JSON:",
    "import numpy as np\n\nclass Model:\n    def __init__(self):\n        self.w = np.zeros(3)\n" * 4,
    "Q: Is the sky blue?\nA:",
]
SPEC = {
    "draft": {"speculative_model": "default"},
    "ngram": {"speculative_method": "ngram"},
    "suffix": {"speculative_method": "suffix"},
    "eagle": {"speculative_method": "eagle"},
    "medusa": {"speculative_method": "medusa"},
}


def _config(**kw) -> EngineConfig:
    kw.setdefault("max_num_seqs", 32)
    return EngineConfig(dtype="float32", max_model_len=512, **kw)


def _workload(params_of) -> list[tuple[str, str, SamplingParams, int]]:
    """Every constraint with every prompt, arriving over the first steps."""
    rng = random.Random(7)
    out = []
    for i, c in enumerate(CONSTRAINTS):
        for j, p in enumerate(PROMPTS):
            out.append((f"c{i}-p{j}", p, params_of(c, i * 10 + j), rng.randrange(6)))
    return out


def _valid(c: Constraint, text: str) -> bool:
    if c.kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), c.schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if c.kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    return True  # regex, grammar, choice: checked by the greedy reference below


@pytest.fixture(scope="module")
def greedy_reference():
    reqs = _workload(lambda c, _: SamplingParams(temperature=0, max_tokens=64, constraint=c))
    engine = LLMEngine(_config(max_num_batched_tokens=64, num_kv_blocks=48))  # 768 tokens: preemption
    finals: dict = {}
    out = run_together(reqs, engine, finals)
    engine.check_idle_invariants()
    return reqs, out, finals


def test_constrained_outputs_match_their_constraint(greedy_reference):
    reqs, _, finals = greedy_reference
    by_id = {rid: params.constraint for rid, _, params, _ in reqs}
    stopped = 0
    for rid, o in finals.items():
        c, comp = by_id[rid], o.outputs[0]
        assert comp.finish_reason in ("stop", "length"), (rid, comp.finish_reason, o.error)
        assert comp.constraint_unfinished == (comp.finish_reason == "length"), rid
        if comp.finish_reason == "stop":
            stopped += 1
            assert _valid(c, comp.text), (rid, comp.text)
            if c.kind == "choice":
                assert comp.text in c.value
    assert stopped >= len(finals) * 3 // 4, f"only {stopped} of {len(finals)} finished inside 64 tokens"


@pytest.mark.slow
@pytest.mark.parametrize("method", list(SPEC))
def test_constrained_greedy_with_speculation_equals_plain(greedy_reference, method):
    reqs, expected, _ = greedy_reference
    engine = LLMEngine(
        _config(
            max_num_batched_tokens=64,
            num_kv_blocks=56,  # preemption here too (the proposers' own blocks come out of it for eagle)
            num_speculative_tokens=4,
            speculative_adaptive=False,
            **SPEC[method],
        )
    )
    finals: dict = {}
    got = run_together(reqs, engine, finals)
    engine.check_idle_invariants()
    assert got == expected
    refused = sum(o.outputs[0].spec.grammar_refused for o in finals.values() if o.outputs[0].spec is not None)
    proposed = sum(o.outputs[0].num_spec_proposed for o in finals.values())
    assert proposed > 0
    assert refused <= proposed


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_seeded_constrained_sampling_equals_plain_seeded(method):
    reqs = _workload(lambda c, n: SamplingParams(temperature=0.9, seed=1000 + n, max_tokens=40, constraint=c))
    plain = run_together(reqs, LLMEngine(_config(max_num_batched_tokens=96)))
    engine = LLMEngine(_config(max_num_batched_tokens=96, num_speculative_tokens=3, **SPEC[method]))
    assert run_together(reqs, engine) == plain
    engine.check_idle_invariants()


# ---------------------------------------------------------------- the sampled distribution

CHOICES = ["yes", "no", "maybe", "yes sir", "nope"]
CHOICE_PROMPT = "Q: Will it rain tomorrow? Say yes, no, maybe, yes sir or nope.\nA: "
TEMPERATURE = 1.3  # flatter than the model: many sequences have a count worth testing
N = 3000
ALPHA = 1e-3


def _exact_choice_distribution() -> dict[tuple[int, ...], float]:
    """P(token sequence) under the masked target, for every allowed path to a stop token: the
    target's logits from transformers, the mask from xgrammar's matcher."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    folder = default_model_path("target")
    hf_tok = load_tokenizer(folder).hf
    model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    stops = sorted({model.config.eos_token_id, hf_tok.eos_token_id} - {None})
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab, stop_token_ids=stops)
    grammar = xgr.GrammarCompiler(info).compile_grammar(
        " | ".join(json.dumps(c) for c in CHOICES).join(("root ::= ", ""))
    )
    prompt = hf_tok.encode(CHOICE_PROMPT)
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        m = xgr.GrammarMatcher(grammar)
        for t in prefix:
            assert m.accept_token(t)
        mask = xgr.allocate_token_bitmask(1, vocab)
        m.fill_next_token_bitmask(mask, 0)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1].float()
        xgr.apply_token_bitmask_inplace(logits.unsqueeze(0), mask)
        probs = torch.softmax(logits / TEMPERATURE, -1)
        for t in torch.nonzero(probs > 0).flatten().tolist():
            p = prob * float(probs[t])
            if t in stops:
                out[(*prefix, t)] = out.get((*prefix, t), 0.0) + p
            elif p > 1e-4:  # paths below this are pooled (expected < 1 in N draws)
                walk([*prefix, t], p)

    walk([], 1.0)
    assert 0.99 < sum(out.values()) <= 1.0 + 1e-6
    return out


@pytest.fixture(scope="module")
def exact_choice():
    return _exact_choice_distribution()


def _chi2(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]) -> float:
    """p-value; sequences expected fewer than 5 times pooled in one bin (with those not enumerated)."""
    n = sum(counts.values())
    big = [s for s, p in probs.items() if p * n >= 5]
    obs = [counts.get(s, 0) for s in big]
    exp = [probs[s] * n for s in big]
    rest_p = 1.0 - sum(probs[s] for s in big)
    if rest_p * n >= 5:
        obs.append(n - sum(obs))
        exp.append(rest_p * n)
    exp = [e * n / sum(exp) for e in exp]
    assert len(obs) >= 3
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["none", "draft", "ngram"])
def test_sampled_constrained_output_follows_the_masked_target(exact_choice, spec):
    kw = {} if spec == "none" else {"num_speculative_tokens": 3, "speculative_adaptive": False, **SPEC[spec]}
    engine = LLMEngine(_config(max_num_seqs=256, max_num_batched_tokens=2048, **kw))
    c = Constraint.choice(CHOICES)
    # the prompt lists the choices, so n-gram lookup drafts from it; unseeded: rejection sampling
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=16, constraint=c)
    for i in range(N):
        engine.add_request(str(i), CHOICE_PROMPT, params)
    counts: dict[tuple[int, ...], int] = {}
    proposed = 0
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            comp = o.outputs[0]
            assert comp.finish_reason == "stop" and comp.text in CHOICES, (comp.text, o.error)
            counts[tuple(comp.token_ids)] = counts.get(tuple(comp.token_ids), 0) + 1
            proposed += comp.num_spec_proposed
    engine.check_idle_invariants()
    if spec != "none":
        assert proposed > N // 4  # drafts were verified, not skipped
    assert _chi2(counts, exact_choice) > ALPHA


def test_the_chi_square_check_rejects_an_unmasked_sample(exact_choice):
    """Power: the same check rejects counts drawn from the distribution with the first token left
    unmasked but renormalized over the allowed paths (a verifier that forgot the first row's mask)."""
    rng = random.Random(0)
    seqs = list(exact_choice)
    weights = [exact_choice[s] ** 0.5 for s in seqs]  # a flatter distribution over the same paths
    counts: dict[tuple[int, ...], int] = {}
    for s in rng.choices(seqs, weights, k=N):
        counts[s] = counts.get(s, 0) + 1
    assert _chi2(counts, exact_choice) < ALPHA


# ---------------------------------------------------------------- errors and containment


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(_config(num_kv_blocks=64))


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint.json_schema({"type": "strin"}), "invalid"),
        (Constraint.json_schema({"type": "object", "not": {"required": ["a"]}}), "'not'"),
        (Constraint.json_schema({"allOf": [{"type": "integer"}, {"minimum": 3}]}), "allOf"),
        (Constraint.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
        (Constraint.json_schema({"type": "string", "pattern": "(("}), "is not a 'regex'"),
        (Constraint.json_schema({"enum": []}), "enum"),
        (Constraint.regex("("), "parenthesis"),
        (Constraint.regex(r"[^\s\S]"), "can match nothing"),
        (Constraint.grammar('root ::= "a" | '), "cannot be compiled"),
        (Constraint.grammar('start ::= "a"'), "cannot be compiled"),
    ],
)
def test_a_constraint_that_cannot_be_used_is_refused_before_queueing(engine, constraint, message):
    free = engine.blocks.num_free_blocks
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", "hello", SamplingParams(constraint=constraint))
    assert "bad" not in engine.requests and "bad" not in engine.grammars.states
    assert engine.blocks.num_free_blocks == free
    engine.add_request("good", "hello", SamplingParams(max_tokens=8, constraint=Constraint.choice(["ok"])))
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            assert o.outputs[0].text == "ok"
    engine.check_idle_invariants()


def test_a_continuation_must_satisfy_the_constraint(engine):
    tok = engine.tokenizer
    assert tok is not None
    c = Constraint.json_schema(SCHEMA)
    with pytest.raises(ValueError, match="continuation"):
        engine.add_request("x", "hi", SamplingParams(max_tokens=40, constraint=c), continuation=tok.encode("[1"))
    engine.check_idle_invariants()
    head = tok.hf.encode('{"name": "bo', add_special_tokens=False)
    engine.add_request("y", "hi", SamplingParams(temperature=0, max_tokens=60, constraint=c), continuation=head)
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            text = tok.decode(o.outputs[0].token_ids)
            assert text.startswith('{"name": "bo')
            if o.outputs[0].finish_reason == "stop":
                jsonschema.validate(json.loads(text), SCHEMA)
    engine.check_idle_invariants()


def test_constraints_need_a_tokenizer():
    e = LLMEngine(_config(num_kv_blocks=32, skip_tokenizer_init=True))
    with pytest.raises(ValueError, match="tokenizer"):
        e.add_request("a", [1, 2, 3], SamplingParams(constraint=Constraint.json_object()))
    e.check_idle_invariants()


def test_length_and_stop_strings_say_the_constraint_is_unfinished(engine):
    c = Constraint.json_schema(SCHEMA)
    engine.add_request("len", "x", SamplingParams(temperature=0, max_tokens=3, constraint=c))
    engine.add_request("stop", "x", SamplingParams(temperature=0, max_tokens=60, constraint=c, stop=['"name"']))
    engine.add_request("whole", "x", SamplingParams(temperature=0, max_tokens=80, constraint=c))
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            finals[o.request_id] = o.outputs[0]
    assert finals["len"].finish_reason == "length" and finals["len"].constraint_unfinished
    assert finals["stop"].finish_reason == "stop" and finals["stop"].constraint_unfinished
    assert finals["whole"].finish_reason == "stop" and not finals["whole"].constraint_unfinished
    engine.check_idle_invariants()


def test_compiling_is_cached_across_requests(engine):
    compiler = engine.intake.grammar
    assert compiler is not None
    c = Constraint.regex(r"[a-f]{4}-cache-test")
    before = compiler.stats.compiles
    for i in range(3):
        engine.add_request(f"r{i}", "x", SamplingParams(max_tokens=20, constraint=c))
    assert compiler.stats.compiles == before + 1 and compiler.stats.hits >= 2
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_idle_invariants()


class _Broken:
    """A matcher whose mask filling fails (a fault in the grammar library, injected)."""

    def fill_next_token_bitmask(self, *a, **k):
        raise RuntimeError("matcher fault injected")


def test_a_failing_matcher_fails_its_request_alone():
    engine = LLMEngine(_config(num_kv_blocks=64, speculative_method="ngram"))
    c = Constraint.json_schema(SCHEMA)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, "The answer, as JSON:", SamplingParams(temperature=0, max_tokens=60, constraint=c))
    engine.step()
    engine.grammars.states["b"].matcher = _Broken()
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            finals[o.request_id] = o
        engine.check_invariants()
    assert finals["b"].outputs[0].finish_reason == "error" and "matcher fault injected" in (finals["b"].error or "")
    for rid in ("a", "c"):
        assert finals[rid].outputs[0].finish_reason == "stop", finals[rid].error
        jsonschema.validate(json.loads(finals[rid].outputs[0].text), SCHEMA)
    engine.check_idle_invariants()
