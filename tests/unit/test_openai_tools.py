"""Tool calling in OpenAI chat bodies (gateway/openai/tools.py, tool_parsers.py): ``tools`` and
``tool_choice`` mapped onto the prompt and the constraint (the schema of ``required`` checked with
``jsonschema`` against calls it must take and refuse), the history's tool messages, every 400
naming its field, and the output parsers: Hermes blocks, the required array and a named function,
whole and streamed in every split, malformed and cut-off output."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftwise.gateway.openai import tool_parsers as T
from draftwise.gateway.openai.protocol import ApiError, parse_chat
from draftwise.gateway.openai.tools import EMPTY_PARAMETERS, Tool, ToolPlan, parse_tools, required_schema
from draftwise.v1 import generation_pb2 as pb

MSG = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]
PLAN = ToolPlan("auto", frozenset({"get_weather", "now"}))


def chat(**fields: object):
    return parse_chat({"messages": MSG, **fields})


# ---------------------------------------------------------------------- requests


def test_auto_is_the_default_with_tools_and_renders_them() -> None:
    p = chat(tools=TOOLS)
    assert p.tools == ToolPlan("auto", frozenset({"get_weather", "now"}), None, True)
    rendered = json.loads(p.start.prompt.chat.tools_json)
    assert [t["function"]["name"] for t in rendered] == ["get_weather", "now"]
    assert rendered[0]["function"]["parameters"] == WEATHER and rendered[0]["function"]["description"] == "Weather now"
    assert rendered[1]["function"]["parameters"] == EMPTY_PARAMETERS  # a tool without parameters takes none
    assert p.start.sampling_params.WhichOneof("constraint") is None  # auto: the model decides, the parser reads


def test_none_keeps_the_tools_out() -> None:
    for fields in ({"tools": TOOLS, "tool_choice": "none"}, {"tool_choice": "none"}, {"tools": []}, {}):
        p = chat(**fields)
        assert p.tools is None and p.start.prompt.chat.tools_json == ""
        assert p.start.sampling_params.WhichOneof("constraint") is None


def test_required_is_a_schema_of_calls() -> None:
    p = chat(tools=TOOLS, tool_choice="required")
    assert p.tools is not None and p.tools.mode == "required"
    assert p.start.prompt.chat.tools_json  # the model still sees the tools
    schema = json.loads(p.start.sampling_params.json_schema)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [
        [{"name": "get_weather", "arguments": {"city": "Paris"}}],
        [{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}],
    ]
    bad = [
        [],  # at least one call
        [{"name": "get_time", "arguments": {}}],  # not a tool
        [{"name": "get_weather", "arguments": {}}],  # city is required
        [{"name": "get_weather", "arguments": {"city": "x", "unit": "k"}}],  # unit out of its enum
        [{"name": "now"}],  # arguments required
        [{"name": "now", "arguments": {}, "extra": 1}],
        {"name": "now", "arguments": {}},  # an array, not one object
    ]
    for value in ok:
        jsonschema.validate(value, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    one = json.loads(
        chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).start.sampling_params.json_schema
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok[1], one)
    jsonschema.validate(ok[0], one)
    # one tool: its call object itself, no anyOf
    assert required_schema([Tool("get_weather", None, WEATHER)])["items"]["properties"]["name"] == {
        "const": "get_weather"
    }
    assert parse_tools({"tools": TOOLS, "tool_choice": "required"}).constraint is not None


def test_a_named_function_is_its_parameters_schema() -> None:
    p = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert p.tools == ToolPlan("named", frozenset({"get_weather", "now"}), "get_weather", True)
    assert json.loads(p.start.sampling_params.json_schema) == WEATHER
    q = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert json.loads(q.start.sampling_params.json_schema) == EMPTY_PARAMETERS


def test_history_with_tool_calls_and_tool_results() -> None:
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    ]
    p = parse_chat({"messages": messages, "tools": TOOLS, "parallel_tool_calls": True})
    m = p.start.prompt.chat.messages
    assert m[1].content == "" and [(c.id, c.name, c.arguments) for c in m[1].tool_calls] == [
        ("call_1", "get_weather", '{"city":"Paris"}'),
        ("call_2", "now", "{}"),
    ]
    assert (m[2].role, m[2].tool_call_id, m[2].content, m[2].name) == ("tool", "call_1", "18 C", "get_weather")
    assert (m[3].tool_call_id, m[3].content) == ("call_2", "noon")


def _call(args: object = "{}", **kw: object) -> dict:
    return {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": args}, **kw}]}  # fmt: skip


F = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize(
    ("fields", "param", "match"),
    [
        ({"tools": "f"}, "tools", "must be a list"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools", "at most 128"),
        ({"tools": ["f"]}, "tools[0]", "must be an object"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "only function tools"),
        ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type", "only function tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name", "non-empty"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name", "non-empty"),
        ({"tools": [{"type": "function", "function": {"name": "f" * 257}}]}, "tools[0].function.name", "at most"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
            "tools[0].function.description",
            "must be a string",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
            "JSON schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": float("inf")}}}]},
            "tools[0].function.parameters",
            "not valid JSON",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
            "tools[0].function.strict",
            "true or false",
        ),
        ({"tools": F + F}, "tools[1].function.name", "defined twice"),
        ({"tool_choice": "auto"}, "tool_choice", "tool calling"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs tools"),
        ({"tools": F, "tool_choice": "any"}, "tool_choice", "must be 'none', 'auto', 'required'"),
        ({"tools": F, "tool_choice": 1}, "tool_choice", "must be 'none'"),
        ({"tools": F, "tool_choice": {"type": "allowed_tools"}}, "tool_choice.type", "named function"),
        ({"tools": F, "tool_choice": {"type": "function"}}, "tool_choice.function.name", "must name"),
        (
            {"tools": F, "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice.function.name",
            "not among",
        ),  # fmt: skip
        ({"tools": F, "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
        ({"messages": [{**_call(), "role": "user"}]}, "messages[0].tool_calls", "only assistant"),
        ({"messages": [{"role": "assistant", "tool_calls": "f"}]}, "messages[0].tool_calls", "must be a list"),
        ({"messages": [{"role": "assistant", "tool_calls": ["f"]}]}, "messages[0].tool_calls[0]", "must be an object"),
        ({"messages": [_call(type="custom")]}, "messages[0].tool_calls[0].type", "must be 'function'"),
        ({"messages": [_call(id=5)]}, "messages[0].tool_calls[0].id", "must be a string"),
        ({"messages": [_call(function=None)]}, "messages[0].tool_calls[0].function", "must be an object"),
        ({"messages": [_call(function={"arguments": "{}"})]}, "messages[0].tool_calls[0].function.name", "non-empty"),
        ({"messages": [_call("{oops")]}, "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
        ({"messages": [_call("[1]")]}, "messages[0].tool_calls[0].function.arguments", "a JSON object"),
        ({"messages": [_call(5)]}, "messages[0].tool_calls[0].function.arguments", "JSON text"),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].tool_call_id", "the id of the tool call"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[0].tool_call_id", "the id"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages[0].tool_call_id",
            "only tool",
        ),
        ({"messages": [{"role": "tool", "tool_call_id": "c", "content": ""}]}, "messages[0].content", "is empty"),
        ({"messages": [{"role": "tool", "tool_call_id": "c"}]}, "messages[0].content", "is empty"),
        ({"messages": [{"role": "user", "content": "x", "name": 7}]}, "messages[0].name", "must be a string"),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ],
)
def test_bad_tool_fields(fields: dict[str, object], param: str, match: str) -> None:
    with pytest.raises(ApiError, match=match) as err:
        parse_chat({"messages": MSG, **fields})
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_completions_refuse_tools() -> None:
    from draftwise.gateway.openai.protocol import parse_completion

    for name, value in (("tools", F), ("tool_choice", "auto")):
        with pytest.raises(ApiError, match="/v1/chat/completions") as err:
            parse_completion({"prompt": "x", name: value})
        assert err.value.param == name


# ---------------------------------------------------------------------- parsing outputs


def whole(plan: ToolPlan, text: str) -> dict:
    return T.message(plan, text)


def streamed(plan: ToolPlan, pieces: list[str]) -> dict:
    """The message a client builds from the stream's deltas (as the SDKs accumulate them)."""
    parser = T.new_parser(plan)
    deltas = [T.delta(parser.feed(p)) for p in pieces] + [T.delta(parser.finish())]
    content = ""
    calls: dict[int, dict] = {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] not in calls and c["type"] == "function"
                calls[c["index"]] = {"id": c["id"], "type": "function", "function": dict(c["function"])}
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    msg: dict = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        assert sorted(calls) == list(range(len(calls)))
        msg["tool_calls"] = [calls[i] for i in range(len(calls))]
    return msg


def same_but_ids(a: dict, b: dict) -> None:
    strip = lambda m: {**m, "tool_calls": [{**c, "id": "x"} for c in m.get("tool_calls", [])]}  # noqa: E731
    assert strip(a) == strip(b)


def splits(text: str, rng: random.Random, n: int = 12) -> list[list[str]]:
    """``text`` cut into pieces: one character each, at every single position, and at random."""
    out = [list(text), [text]]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def check_all_splits(plan: ToolPlan, text: str) -> dict:
    expected = whole(plan, text)
    rng = random.Random(text)
    for pieces in splits(text, rng):
        same_but_ids(streamed(plan, pieces), expected)
    return expected


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def calls_of(msg: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]


def test_hermes_one_call_no_content() -> None:
    msg = check_all_splits(PLAN, CALL)
    assert msg["content"] is None and calls_of(msg) == [("get_weather", {"city": "Paris"})]
    c = msg["tool_calls"][0]
    assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29


def test_hermes_text_around_calls_and_several_calls() -> None:
    text = f"Let me look.\n{CALL}\n" + '<tool_call>{"name": "now", "arguments": {}}</tool_call>\nDone.'
    msg = check_all_splits(PLAN, text)
    assert msg["content"] == "Let me look.\nDone."
    assert calls_of(msg) == [("get_weather", {"city": "Paris"}), ("now", {})]
    ids = [c["id"] for c in msg["tool_calls"]]
    assert len(set(ids)) == 2


def test_hermes_plain_text_comes_back_whole() -> None:
    for text in (
        "Hello, world.  ",
        "a < b and c <tool but not a call <tool_cal",
        "",
        "   ",
        "x\n\n",
        "<",
        "<tool_call",
    ):
        msg = check_all_splits(PLAN, text)
        assert msg == {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',  # not one of the tools
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
        '<tool_call>["now"]</tool_call>',
        '<tool_call>{"name": "now", "arguments": "not json"}</tool_call>',
    ],
)
def test_hermes_blocks_that_are_not_calls_stay_content(block: str) -> None:
    msg = check_all_splits(PLAN, f"A {block} B")
    assert msg == {"role": "assistant", "content": f"A {block} B"}


def test_hermes_arguments_as_json_text_or_missing() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call><tool_call>{"name": "now"}</tool_call>'  # noqa: E501
    assert calls_of(check_all_splits(PLAN, text)) == [("get_weather", {"city": "Oslo"}), ("now", {})]


def test_hermes_unclosed_block_at_the_end() -> None:
    """A model that stops (EOS) after the JSON without ``</tool_call>`` made its call; a block cut
    inside its JSON (max_tokens) is content."""
    done = check_all_splits(PLAN, 'Sure. <tool_call>\n{"name": "now", "arguments": {}}\n')
    assert done["content"] == "Sure." and calls_of(done) == [("now", {})]
    cut = check_all_splits(PLAN, '<tool_call>\n{"name": "now", "argu')
    assert cut == {"role": "assistant", "content": '<tool_call>\n{"name": "now", "argu'}


def test_hermes_without_parallel_calls_keeps_the_first() -> None:
    plan = ToolPlan("auto", PLAN.names, None, parallel=False)
    msg = check_all_splits(plan, CALL + '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    assert calls_of(msg) == [("get_weather", {"city": "Paris"})]


def test_hermes_holds_back_only_what_may_start_a_block() -> None:
    p = T.new_parser(PLAN)
    assert T.delta(p.feed("Hi <tool")) == {"content": "Hi"}  # " <tool" may start a block
    assert T.delta(p.feed("s are fun")) == {"content": " <tools are fun"}
    assert T.delta(p.feed(" <tool_call>{")) == {}
    (call,) = T.delta(p.feed('"name": "now"}</tool_call>'))["tool_calls"]
    assert call.pop("id").startswith("call_")
    assert call == {"index": 0, "type": "function", "function": {"name": "now", "arguments": "{}"}}
    assert T.delta(p.finish()) == {}
    assert p.calls == 1


REQ = ToolPlan("required", PLAN.names)


def test_required_array_one_call_per_element() -> None:
    text = ' [{"name": "get_weather", "arguments": {"city": "Pa\\"ris]}"}}, {"name": "now", "arguments": {}}] '
    msg = check_all_splits(REQ, text)
    assert msg["content"] is None
    assert calls_of(msg) == [("get_weather", {"city": 'Pa"ris]}'}), ("now", {})]


def test_required_array_with_nested_arrays_and_objects_in_arguments() -> None:
    plan = ToolPlan("required", frozenset({"plot"}))
    args = {"points": [[1, 2], [3, {"z": [4]}]], "style": {"colors": ["red", "{"]}}
    text = json.dumps([{"name": "plot", "arguments": args}, {"name": "plot", "arguments": {"points": []}}])
    msg = check_all_splits(plan, text)
    assert [(n, a) for n, a in calls_of(msg)] == [("plot", args), ("plot", {"points": []})]


def test_required_array_streams_each_call_as_its_element_ends() -> None:
    p = T.new_parser(REQ)
    assert T.delta(p.feed('[{"name": "now", "arguments": {')) == {}
    d = T.delta(p.feed('}}, {"name": "get_weather", '))
    assert [c["function"] for c in d["tool_calls"]] == [{"name": "now", "arguments": "{}"}]
    d = T.delta(p.feed('"arguments": {"city": "x"}}]'))
    assert d["tool_calls"][0]["index"] == 1 and json.loads(d["tool_calls"][0]["function"]["arguments"]) == {"city": "x"}
    assert T.delta(p.finish()) == {}


def test_required_array_cut_short_or_not_an_array() -> None:
    cut = check_all_splits(REQ, '[{"name": "now", "arguments": {}}, {"name": "get_weather", "argu')
    assert calls_of(cut) == [("now", {})] and cut["content"] == '{"name": "get_weather", "argu'
    nothing = check_all_splits(REQ, '[{"name": "now", "argu')
    assert nothing == {"role": "assistant", "content": '[{"name": "now", "argu'}
    prose = check_all_splits(REQ, "I will not call a tool.")
    assert prose == {"role": "assistant", "content": "I will not call a tool."}
    unknown = check_all_splits(REQ, '[{"name": "rm", "arguments": {}}]')
    assert unknown == {"role": "assistant", "content": '[{"name": "rm", "arguments": {}}]'}
    trailing = check_all_splits(REQ, '[{"name": "now", "arguments": {}}] and more')
    assert calls_of(trailing) == [("now", {})] and trailing["content"] == "] and more"


NAMED = ToolPlan("named", PLAN.names, "get_weather")


def test_named_function_output_is_its_arguments() -> None:
    msg = check_all_splits(NAMED, '\n {"city": "Paris", "unit": "c"} \n')
    assert msg["content"] is None and calls_of(msg) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "unit": "c"}'
    p = T.new_parser(NAMED)
    assert T.delta(p.feed("  ")) == {}
    first = T.delta(p.feed('{"ci'))["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": '{"ci'} and first["id"].startswith("call_")
    assert T.delta(p.feed('ty": "P"}')) == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "P"}'}}]}
    assert T.delta(p.finish()) == {} and p.calls == 1
    assert whole(NAMED, "") == {"role": "assistant", "content": ""}  # nothing written, nothing called


def test_call_ids_are_fresh() -> None:
    assert len({T.call_id() for _ in range(100)}) == 100


def test_finished_proto_flag_exists() -> None:
    assert pb.Finished(constraint_unfinished=True).constraint_unfinished


FRAGMENTS = (
    "<tool_call>", "</tool_call>", "<tool", "_call>", "</tool", "<", ">", " ", "\n", "Hi", "ok.", "{", "}", "[", "]",
    ",", '"', '\\"', '{"name": "now", "arguments": {}}', '{"name": "get_weather", "arguments": {"city": "a b"}}',
    '{"name": "nope"}', '"arguments"', ": ", CALL, '<tool_call>{"name": "now"}</tool_call>', '<tool_call>\n{"name": "now"}',
    '[{"name": "now", "arguments": {}}', ', {"name": "get_weather", "arguments": {"city": "]"}}', "]",
)  # fmt: skip
"""Pieces of model output: whole calls (Hermes blocks, array elements) and the characters that could confuse a reader."""


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=14),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
    mode=st.sampled_from(["auto", "required", "named"]),
    parallel=st.booleans(),
)
def test_any_output_streamed_in_any_pieces_reads_as_it_does_whole(
    parts: list[str], cuts: list[int], mode: str, parallel: bool
) -> None:
    """Whatever the model writes and however the stream cuts it, the client assembles the message
    the non-streaming answer has; text without a block comes back unchanged in auto mode."""
    text = "".join(parts)
    plan = ToolPlan(mode, PLAN.names, "now" if mode == "named" else None, parallel)  # type: ignore[arg-type]
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    expected = whole(plan, text)
    same_but_ids(streamed(plan, pieces), expected)
    if mode == "auto" and "tool_calls" not in expected:  # no call made: the text comes back unchanged
        assert expected == {"role": "assistant", "content": text}
    for call in expected.get("tool_calls", []):
        assert call["function"]["name"] in PLAN.names
        if mode != "named":
            assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_what_the_endpoint_accepts_the_gateway_and_worker_rules_accept() -> None:
    """Every body accepted here maps onto a request the gateway's shared checks (the worker's
    rules) take: the tools JSON, the tool messages, the constraint."""
    from draftwise.gateway.sampling_check import check_sampling
    from draftwise.gateway.validate import validate_chat

    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [_call('{"city": "x"}')["tool_calls"][0]]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny", "name": "f"},
    ]
    named = {"type": "function", "function": {"name": "now"}}
    for fields in (
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
        {"tools": TOOLS, "tool_choice": named},
        {"tools": TOOLS, "tool_choice": "none"},
        {"messages": history, "tools": TOOLS},
        {"messages": history},
    ):
        p = parse_chat({"messages": MSG, **fields})
        validate_chat(p.start.prompt.chat)
        check_sampling(p.start.sampling_params)
