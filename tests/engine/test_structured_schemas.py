"""Structured output over generated JSON schemas (issue 27): every finished output validates.

The generator (tests/engine/schema_gen.py) is checked first, without a model: its schemas are
valid Draft 2020-12 schemas inside the subset the engine compiles, bounded, varied, and compile
with xgrammar against the default model's vocabulary; the grammar accepts valid instances and
refuses broken ones; random walks through the grammar (a random allowed token each step, as a
model under the mask would pick) end in JSON that validates, apart from xgrammar 0.2.9's known
defects, which are counted and told apart (see ``_walk_verdict``).

Then the engine: all ``N_SCHEMAS`` schemas submitted together to one engine per configuration
(no speculation, n-gram lookup, the embedded draft model; prefix caching on, as by default),
greedy and sampled (temperature 0.8, a fixed seed per request): no request fails, the engine is
idle and owns nothing afterwards, every output that finished with its constraint complete parses
as JSON and validates against its schema, most finish ("stop"), and constrained greedy output is
token for token the same with and without speculation.
"""

from __future__ import annotations

import functools
import json
import random
import time
from typing import Any

import jsonschema
import numpy as np
import pytest

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.paths import resolve_model
from draftwise.worker.sampling.constraints import Constraint
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.text.tokenizer import load_tokenizer
from tests.engine.schema_gen import (
    MAX_CHARS,
    MAX_DEPTH,
    Schema,
    example,
    generate_schemas,
    invalid_examples,
    max_chars,
    summary,
)

N_SCHEMAS = 200
SEED = 2027
MAX_TOKENS = 160
MIN_FINISHED = 0.8
"""Least fraction of requests that must end with their constraint complete (finish_reason "stop")."""
SCHEMAS = generate_schemas(N_SCHEMAS, SEED)
ALLOWED_KEYWORDS = {
    "type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf",
    "minLength", "maxLength", "minimum", "maximum", "minItems", "maxItems", "$defs", "$ref",
}  # fmt: skip
FIXED_K = {"num_speculative_tokens": 2, "speculative_adaptive": False}
SPEC = {
    "off": {},
    "ngram": {"speculative_method": "ngram", **FIXED_K},
    "draft": {"speculative_model": "default", **FIXED_K},
}
"""Speculation at a fixed k: the adaptive policy switches drafting off where a batch this large makes
it not pay on a CPU, and the suite is about what drafting does to constrained output."""
MODES = ("greedy", "sampled")


@functools.cache
def _xgrammar() -> tuple[Any, Any]:
    """(xgrammar's compiler over the default model's vocabulary, its decoded vocabulary)."""
    import xgrammar as xg

    tok = load_tokenizer(resolve_model(None)).hf
    info = xg.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    return xg.GrammarCompiler(info), info.decoded_vocab


# --- the generator ----------------------------------------------------------------------------


def _walk_schema(s: Any, depth: int, visit) -> None:
    """Call ``visit(node, object depth)`` on every subschema."""
    if not isinstance(s, dict):
        return
    visit(s, depth)
    inner = depth + (s.get("type") == "object")
    for sub in s.get("properties", {}).values():
        _walk_schema(sub, inner, visit)
    for sub in s.get("$defs", {}).values():
        _walk_schema(sub, 1, visit)
    for sub in s.get("anyOf", []):
        _walk_schema(sub, depth, visit)
    if "items" in s:
        _walk_schema(s["items"], depth, visit)


def test_generator_is_seeded_varied_and_bounded():
    assert generate_schemas(N_SCHEMAS, SEED) == SCHEMAS
    assert generate_schemas(N_SCHEMAS, SEED + 1) != SCHEMAS
    assert len({json.dumps(s, sort_keys=True) for s in SCHEMAS}) == len(SCHEMAS) >= 200
    problems: list[str] = []

    def check(node: Schema, depth: int) -> None:
        where = json.dumps(node)[:80]
        if not set(node) <= ALLOWED_KEYWORDS:
            problems.append(f"keywords {set(node) - ALLOWED_KEYWORDS} in {where}")
        if depth > MAX_DEPTH:
            problems.append(f"object at depth {depth}: {where}")
        t = node.get("type")
        if t == "string" and "enum" not in node and not node.get("maxLength", 99) <= 8:
            problems.append(f"unbounded string {where}")
        if t == "array" and not node.get("maxItems", 99) <= 3:
            problems.append(f"unbounded array {where}")
        if t == "integer" and not ("minimum" in node and "maximum" in node and node["maximum"] <= 999):
            problems.append(f"unbounded integer {where}")
        if t == "object" and node.get("additionalProperties") is not False:
            problems.append(f"object without additionalProperties: false {where}")
        if t == "number":
            problems.append(f"free number {where}")

    for s in SCHEMAS:
        _walk_schema(s, 0, check)
        assert max_chars(s) <= MAX_CHARS
    assert not problems, problems[:10]
    uses = summary(SCHEMAS)
    for keyword in ("anyOf", "enum", "const", "minItems", "minLength", "$ref", "type:null", "type:boolean"):
        assert uses.get(keyword, 0) >= 20, (keyword, uses)
    depths = [0]
    for s in SCHEMAS:
        _walk_schema(s, 0, lambda node, d: depths.append(d + (node.get("type") == "object")))
    assert max(depths) == MAX_DEPTH
    tops = {s.get("type", "anyOf" if "anyOf" in s else "other") for s in SCHEMAS}
    assert {"object", "array", "anyOf"} <= tops


def test_every_schema_is_valid_and_compiles():
    compiler, _ = _xgrammar()
    for s in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(s)
        compiler.compile_json_schema(json.dumps(s))


def _matcher_accepts(compiled: Any, text: str) -> bool:
    import xgrammar as xg

    m = xg.GrammarMatcher(compiled)
    return bool(m.accept_string(text)) and bool(m.is_completed())


def test_grammar_agrees_with_jsonschema_on_instances():
    """Valid instances (compact JSON and json.dumps' spacing) are accepted by the grammar,
    broken ones (a string too long, an integer out of range, a required property missing, an
    unknown property, an item too many, a wrong type) refused by both."""
    compiler, _ = _xgrammar()
    rng = random.Random(SEED)
    disagree: list[str] = []
    n_invalid = 0
    for s in SCHEMAS:
        compiled = compiler.compile_json_schema(json.dumps(s))
        validator = jsonschema.Draft202012Validator(s)
        for _ in range(3):
            inst = example(s, rng)
            assert validator.is_valid(inst), (s, inst)
            for text in (json.dumps(inst), json.dumps(inst, separators=(",", ":"))):
                if not _matcher_accepts(compiled, text):
                    disagree.append(f"refused valid {text} for {json.dumps(s)}")
        for inst in invalid_examples(s, rng):
            n_invalid += 1
            assert not validator.is_valid(inst), (s, inst)
            if _matcher_accepts(compiled, json.dumps(inst)):
                disagree.append(f"accepted invalid {json.dumps(inst)} for {json.dumps(s)}")
    assert n_invalid >= 5 * len(SCHEMAS)
    assert not disagree, disagree[:5]


def _allowed(matcher: Any, bitmask: Any, vocab_size: int) -> np.ndarray:
    matcher.fill_next_token_bitmask(bitmask)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.nonzero(bits)[0]


def _walk_verdict(out: bytes, validator: Any) -> str:
    """ "ok", or what is wrong with a walk's output: "surrogate" (UTF-8 of a UTF-16 surrogate,
    which xgrammar's string rule admits and strict UTF-8 refuses), "control" (a raw U+0000-U+001F
    inside a string: xgrammar 0.2.9 admits them in strings with minLength/maxLength,
    mlc-ai/xgrammar#800), or "invalid: ..." (anything else: a disagreement this test fails on)."""
    try:
        text = out.decode("utf-8")
    except UnicodeDecodeError:
        try:
            out.decode("utf-8", errors="surrogatepass")
        except UnicodeDecodeError as e:
            return f"invalid: not UTF-8 ({e.reason}): {out!r}"
        return "surrogate"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if "Invalid control character" in e.msg:
            return "control"
        return f"invalid: not JSON ({e.msg}): {text!r}"
    if not validator.is_valid(value):
        return f"invalid: {next(iter(validator.iter_errors(value))).message}: {text!r}"
    return "ok"


def _random_walks(compile_schema, walks: int = 3) -> tuple[dict[str, int], list[str]]:
    """``walks`` walks per schema through ``compile_schema(schema)``'s grammar, each token drawn
    among those the mask allows (the stop token half the time it is allowed, whitespace seldom):
    (how many outputs got each verdict of ``_walk_verdict``, the outputs that are "invalid")."""
    import xgrammar as xg

    _, vocab = _xgrammar()
    rng = random.Random(SEED)
    is_space = np.array([bool(b) and not b.strip() for b in vocab])
    bitmask = xg.allocate_token_bitmask(1, len(vocab))
    verdicts: dict[str, int] = {}
    bad: list[str] = []
    for s in SCHEMAS:
        compiled = compile_schema(s)
        stop = set(compiled.tokenizer_info.stop_token_ids)
        validator = jsonschema.Draft202012Validator(s)
        for _ in range(walks):
            m = xg.GrammarMatcher(compiled)
            out = b""
            for _ in range(400):
                if m.is_terminated():
                    break
                allowed = _allowed(m, bitmask, len(vocab))
                ends = [t for t in allowed if t in stop]
                words = [t for t in allowed if not is_space[t] and t not in stop]
                pool = ends if ends and rng.random() < 0.5 else words if words and rng.random() < 0.95 else allowed
                tid = int(rng.choice(pool))
                assert m.accept_token(tid)
                out += b"" if tid in stop else vocab[tid]
            assert m.is_terminated(), (s, out)
            verdict = _walk_verdict(out, validator)
            key = verdict.split(":")[0]
            verdicts[key] = verdicts.get(key, 0) + 1
            if key != "ok":
                bad.append(f"{verdict} for {json.dumps(s)}")
    return verdicts, bad


def test_random_walks_through_the_grammar_validate():
    """With xgrammar alone: every walk's output that does not hit a known xgrammar defect
    ("control", "surrogate") parses and validates; the defects are counted and shown."""
    compiler, _ = _xgrammar()
    verdicts, bad = _random_walks(lambda s: compiler.compile_json_schema(json.dumps(s)))
    print(f"random walks, xgrammar: {verdicts}")
    invalid = [b for b in bad if b.startswith("invalid")]
    assert not invalid, invalid[:5]
    assert verdicts.get("ok", 0) >= 0.9 * 3 * len(SCHEMAS), verdicts


def test_random_walks_through_the_engines_grammars_validate():
    """The grammars the engine compiles (``GrammarCompiler.compile``, what a request is masked
    with): every walk's output is UTF-8 JSON that validates, with none of xgrammar 0.2.9's defects
    (raw U+0000-U+001F in length-bounded strings, mlc-ai/xgrammar#800; the UTF-8 of surrogates in any
    string): the engine closes those string classes (``grammar._json_ebnf``)."""
    from draftwise.worker.sampling.grammar import GrammarCompiler

    tok = load_tokenizer(resolve_model(None)).hf
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    verdicts, bad = _random_walks(lambda s: compiler.compile(Constraint.json_schema(s)))
    print(f"random walks, the engine's grammars: {verdicts}")
    assert not bad, f"{len(bad)} bad outputs: {bad[:5]}"


# --- the engine ---------------------------------------------------------------------------------


def _prompt(s: Schema) -> str:
    """A short code-like prompt naming the schema's property names (which n-gram lookup can draft)."""
    names: list[str] = []
    _walk_schema(s, 0, lambda node, _: names.extend(k for k in node.get("properties", {}) if k not in names))
    return f"# JSON with {', '.join(names) or 'a value'}\nvalue = "


def _params(mode: str) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.0 if mode == "greedy" else 0.8,
            seed=None if mode == "greedy" else 1000 + i,
            max_tokens=MAX_TOKENS,
            constraint=Constraint.json_schema(s),
        )
        for i, s in enumerate(SCHEMAS)
    ]


@functools.cache
def _run(config: str) -> dict[str, Any]:
    """One engine for ``config``; every schema at once, greedy and sampled together (one batch of
    2 x N_SCHEMAS requests). The final outputs per mode in schema order, and the seconds it took."""
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=512, max_num_seqs=2 * N_SCHEMAS, **SPEC[config]))
    t0 = time.perf_counter()
    for mode in MODES:
        for i, (s, p) in enumerate(zip(SCHEMAS, _params(mode), strict=True)):
            engine.add_request(f"{mode}-{i}", _prompt(s), p)
    outs: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            outs[o.request_id] = o
        steps += 1
    engine.check_idle_invariants()
    assert engine.dead is None
    result: dict[str, Any] = {mode: [outs[f"{mode}-{i}"] for i in range(len(SCHEMAS))] for mode in MODES}
    return result | {"seconds": time.perf_counter() - t0, "steps": steps}


def _check_outputs(outs: list[Any]) -> tuple[list[str], dict[str, int]]:
    """(what is wrong with ``outs``, how many ended how)."""
    problems: list[str] = []
    ends: dict[str, int] = {}
    for s, o in zip(SCHEMAS, outs, strict=True):
        c = o.outputs[0]
        ends[c.finish_reason] = ends.get(c.finish_reason, 0) + 1
        if o.error is not None or c.finish_reason not in ("stop", "length"):
            problems.append(f"{o.request_id}: {c.finish_reason} {o.error}")
            continue
        if c.finish_reason == "stop" and c.constraint_unfinished:
            problems.append(f"{o.request_id}: stopped with its constraint unfinished: {c.text!r}")
        if c.constraint_unfinished:
            continue
        try:
            value = json.loads(c.text)
        except json.JSONDecodeError as e:
            problems.append(f"{o.request_id}: not JSON ({e.msg}): {c.text!r} for {json.dumps(s)}")
            continue
        errors = [e.message for e in jsonschema.Draft202012Validator(s).iter_errors(value)]
        if errors:
            problems.append(f"{o.request_id}: {errors[0]}: {c.text!r} for {json.dumps(s)}")
    return problems, ends


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", list(SPEC))
def test_finished_outputs_validate(config: str, mode: str):
    run = _run(config)
    outs = run[mode]
    problems, ends = _check_outputs(outs)
    stopped = ends.get("stop", 0) / len(outs)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    specs = [o.outputs[0].spec for o in outs if o.outputs[0].spec is not None]
    proposed, accepted = sum(x.proposed for x in specs), sum(x.accepted for x in specs)
    refused = sum(x.grammar_refused for x in specs)
    print(
        f"\n{config}/{mode}: {ends}, {stopped:.1%} finished, {tokens} tokens; drafts {proposed} proposed,"
        f" {accepted} accepted, {refused} refused by the grammar; both modes: {run['steps']} steps, {run['seconds']:.1f} s"
    )
    assert not problems, f"{len(problems)} bad outputs: {problems[:5]}"
    assert stopped >= MIN_FINISHED, ends
    if config != "off":
        assert any(o.outputs[0].num_spec_accepted for o in outs), "speculation never accepted a token"


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ngram", "draft"])
def test_constrained_greedy_is_exact_under_speculation(config: str):
    plain, spec = _run("off")["greedy"], _run(config)["greedy"]
    differ = [
        f"{a.request_id}: {a.outputs[0].text!r} != {b.outputs[0].text!r}"
        for a, b in zip(plain, spec, strict=True)
        if a.outputs[0].token_ids != b.outputs[0].token_ids
    ]
    assert not differ, f"{len(differ)} of {len(plain)} differ: {differ[:5]}"
    refused = sum(o.outputs[0].spec.grammar_refused for o in spec if o.outputs[0].spec is not None)
    if config == "ngram":  # prompt lookup drafts blind: the verify windows' masks refuse some
        assert refused > 0, "no draft was refused by a grammar: the masks of verify windows went untested"
    else:  # the draft model drafts under the request's grammar: nothing it drafts is refused
        assert refused == 0, f"the grammar refused {refused} tokens the draft model drafted under it"
