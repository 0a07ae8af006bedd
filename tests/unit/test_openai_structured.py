"""Structured output in OpenAI request bodies (gateway/openai/structured.py through protocol.py):
``response_format``, vLLM's ``guided_*`` and ``structured_outputs`` keys mapped onto the contract's
constraint oneof, for chat and completions, and the 400 naming the field for every malformed one."""

from __future__ import annotations

import json

import pytest

from draftwise.gateway.openai import protocol as P
from draftwise.gateway.openai.protocol import ApiError, parse_chat, parse_completion
from draftwise.gateway.openai.structured import MAX_CHOICES, MAX_CONSTRAINT_BYTES, constraint_from_body
from draftwise.v1 import generation_pb2 as pb

MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}


def chat_sp(**fields: object) -> pb.SamplingParams:
    return parse_chat({"messages": MSG, **fields}).start.sampling_params


def test_text_format_is_no_constraint() -> None:
    sp = chat_sp(response_format={"type": "text"})
    assert sp.WhichOneof("constraint") is None
    assert chat_sp().WhichOneof("constraint") is None


def test_json_object() -> None:
    sp = chat_sp(response_format={"type": "json_object"})
    assert sp.WhichOneof("constraint") == "json_object" and sp.json_object


def test_json_schema_keeps_the_schema_and_its_key_order() -> None:
    """The schema goes over as JSON text, its properties in the order given (the order the output
    writes them in); name and strict are accepted (strict or not, the schema is enforced)."""
    for strict in (True, False, None):
        fmt = {"type": "json_schema", "json_schema": {"name": "Thing", "schema": SCHEMA, "strict": strict}}
        sp = chat_sp(response_format=fmt)
        assert sp.WhichOneof("constraint") == "json_schema"
        assert json.loads(sp.json_schema) == SCHEMA
        assert list(json.loads(sp.json_schema)["properties"]) == ["b", "a"]
    no_name = chat_sp(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}})
    assert json.loads(no_name.json_schema) == {"type": "integer"}


@pytest.mark.parametrize(
    ("fields", "kind", "value"),
    [
        ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
        ({"guided_regex": r"\d{3}"}, "regex", r"\d{3}"),
        ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"guided_grammar": 'root ::= "a" | "b"'}, "grammar", 'root ::= "a" | "b"'),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", SCHEMA),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
        ({"structured_outputs": {"choice": ["x"]}}, "choice", ["x"]),
        ({"structured_outputs": {"grammar": 'root ::= "z"'}}, "grammar", 'root ::= "z"'),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"structured_outputs": {"regex": "a", "json": None, "disable_fallback": True}}, "regex", "a"),
        ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "regex", "a"),
    ],
)
def test_vllm_keys(fields: dict[str, object], kind: str, value: object) -> None:
    for parse, base in ((parse_chat, {"messages": MSG}), (parse_completion, {"prompt": "p"})):
        sp = parse({**base, **fields}).start.sampling_params
        assert sp.WhichOneof("constraint") == kind
        got = getattr(sp, kind)
        if kind == "json_schema":
            got = json.loads(got)
        elif kind == "choice":
            got = list(got.options)
        assert got == value


def test_completions_take_response_format_and_each_prompt_of_a_batch_gets_it() -> None:
    p = parse_completion({"prompt": ["a", "b"], "response_format": {"type": "json_object"}})
    assert [s.sampling_params.WhichOneof("constraint") for s in p.starts] == ["json_object", "json_object"]


def test_the_constraint_sits_with_the_other_sampling_params() -> None:
    sp = chat_sp(guided_choice=["a", "b"], temperature=0, max_tokens=3, seed=1)
    assert (sp.temperature, sp.max_tokens, sp.seed, list(sp.choice.options)) == (0, 3, 1, ["a", "b"])


BIG = "a" * (MAX_CONSTRAINT_BYTES + 1)


@pytest.mark.parametrize(
    ("fields", "param", "match"),
    [
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
        ({"response_format": {}}, "response_format.type", "got None"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "is missing",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "not a schema"}}},
            "response_format.json_schema.schema",
            "a JSON object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
            "a JSON object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
            "response_format.json_schema.name",
            "must be a string",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
            "response_format.json_schema.strict",
            "true or false",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"x": BIG}}}},
            "response_format.json_schema.schema",
            "larger than",
        ),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": "[1, 2]"}, "guided_json", "a JSON object"),
        ({"guided_json": 5}, "guided_json", "a JSON object"),
        ({"guided_json": {"maximum": float("nan")}}, "guided_json", "not valid JSON"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"guided_regex": 5}, "guided_regex", "non-empty string"),
        ({"guided_regex": BIG}, "guided_regex", "larger than"),
        ({"guided_grammar": "  "}, "guided_grammar", "non-empty string"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": "yes"}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", ""]}, "guided_choice[1]", "non-empty string"),
        ({"guided_choice": ["a", 3]}, "guided_choice[1]", "non-empty string"),
        ({"guided_choice": ["a"] * (MAX_CHOICES + 1)}, "guided_choice", f"at most {MAX_CHOICES}"),
        ({"guided_choice": ["a" * 200_000, "b" * 100_000]}, "guided_choice", "larger than"),
        ({"guided_whitespace_pattern": r"\s*"}, "guided_whitespace_pattern", "not supported"),
        ({"structural_tag": {"x": 1}}, "structural_tag", "not supported"),
        ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
        ({"structured_outputs": {}}, "structured_outputs", "sets no constraint"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "sets no constraint"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "true or false"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not supported"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "not supp"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs.regex", "at most one"),
        ({"structured_outputs": {"choice": [1]}}, "structured_outputs.choice[0]", "non-empty string"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
        ({"guided_json": {}, "guided_choice": ["a"]}, "guided_choice", "at most one"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs", "at most one"),
    ],
)
def test_bad_constraints(fields: dict[str, object], param: str, match: str) -> None:
    for parse, base in ((parse_chat, {"messages": MSG}), (parse_completion, {"prompt": "p"})):
        with pytest.raises(ApiError, match=match) as err:
            parse({**base, **fields})
        assert err.value.status == 400 and err.value.param == param, err.value.message


def test_a_response_format_and_a_forced_tool_conflict() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(ApiError, match="at most one output constraint") as err:
        parse_chat(
            {"messages": MSG, "tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}}
        )
    assert err.value.param == "tool_choice"
    # tool_choice auto imposes no constraint of its own: a response format is fine with it
    p = parse_chat({"messages": MSG, "tools": tools, "response_format": {"type": "json_object"}})
    assert p.start.sampling_params.json_object and p.tools is not None and p.tools.mode == "auto"


def test_constraint_from_body_names_its_source() -> None:
    c = constraint_from_body({"structured_outputs": {"choice": ["a"]}})
    assert c is not None and (c.kind, c.value, c.param) == ("choice", ("a",), "structured_outputs.choice")
    assert constraint_from_body({}) is None


def test_finish_fields_say_when_the_constraint_was_left_unfinished() -> None:
    """``finish_reason`` as the engine says; ``constraint_unfinished: true`` (an extension field)
    only when the constraint was left incomplete; tool calls make ``stop`` into ``tool_calls``."""
    length = pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH, constraint_unfinished=True)
    assert P.finish_fields(length) == {"finish_reason": "length", "constraint_unfinished": True}
    stop = pb.Finished(finish_reason=pb.FINISH_REASON_STOP)
    assert P.finish_fields(stop) == {"finish_reason": "stop"}
    assert P.finish_fields(stop, calls=2) == {"finish_reason": "tool_calls"}
    assert P.finish_fields(pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH), calls=1) == {"finish_reason": "length"}
    cut = pb.Finished(finish_reason=pb.FINISH_REASON_STOP, constraint_unfinished=True)
    assert P.finish_fields(cut) == {"finish_reason": "stop", "constraint_unfinished": True}


def test_speculation_reports_grammar_refused_tokens() -> None:
    s = pb.SpeculationStats(proposed_tokens=10, accepted_tokens=6, grammar_refused_tokens=3)
    out = P.speculation(s)
    assert out is not None and out["grammar_refused_tokens"] == 3 and out["proposed_tokens"] == 10


def test_a_schema_nested_past_the_recursion_limit_is_a_400() -> None:
    """A schema deeper than Python's recursion limit (built here without recursion) is refused,
    never a 500."""
    deep: dict[str, object] = {}
    for _ in range(5000):
        deep = {"a": deep}
    for parse, base in ((parse_chat, {"messages": MSG}), (parse_completion, {"prompt": "p"})):
        with pytest.raises(ApiError, match="nested too deeply") as err:
            parse({**base, "guided_json": deep})
        assert err.value.param == "guided_json"
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    with pytest.raises(ApiError, match="nested too deeply") as err:
        parse_chat({"messages": MSG, "tools": tools})
    assert err.value.param == "tools[0].function.parameters"
