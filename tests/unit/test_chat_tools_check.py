"""Chat tools on the wire: the gateway refuses exactly the chats with tools that the worker
refuses (``gateway/validate.py`` against ``worker/serving/proto_convert.py`` on seeded random
conversations), and the Hermes rewrite a template without tools gets
(``worker/text/chat_tools.py``) writes tools, calls and results as Qwen2.5's template does."""

from __future__ import annotations

import json
import random

import pytest

from draftwise.gateway.errors import RequestError
from draftwise.gateway.validate import validate_chat
from draftwise.v1 import generation_pb2 as pb
from draftwise.worker.serving.proto_convert import prompt_from_proto
from draftwise.worker.text.chat_tools import ToolCall, check_tools, hermes_messages, tool_call_text

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [
    "",
    "  ",
    json.dumps([WEATHER]),
    "[]",
    "{",
    "[" * 3000,
    '{"type": "function"}',
    "[1]",
    '[{"type": "function"}]',
    '[{"type": "retrieval", "function": {"name": "f"}}]',
    '[{"function": {"name": "f"}}]',
    '[{"type": "function", "function": {"name": ""}}]',
    '[{"type": "function", "function": {"name": 3}}]',
    '[{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]',
    '[{"type": "function", "function": {"name": "f", "parameters": []}}]',
    '[{"type": "function", "function": {"name": "f", "parameters": null, "description": null}}]',
    '[{"type": "function", "function": {"name": "f", "description": 1}}]',
    '[{"type": "function", "function": {"name": "f", "strict": "yes"}}]',
    '[{"type": "function", "function": {"name": "f", "strict": true}}]',
]
ROLES = ["user", "assistant", "tool", "system"]
CONTENTS = ["", "hi", "22 C"]
CALLS = [
    [],
    [pb.ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}')],
    [pb.ToolCall(name="get_weather")],
    [pb.ToolCall(id="c2", name="", arguments="{}")],
    [pb.ToolCall(id="c3", name="f", arguments="[1]")],
    [pb.ToolCall(id="c4", name="f", arguments="{nope")],
    [pb.ToolCall(id="c5", name="f", arguments=" ")],
]


def _random_chat(rng: random.Random) -> pb.ChatMessages:
    chat = pb.ChatMessages(tools_json=rng.choice(TOOLS))
    for _ in range(rng.randint(1, 4)):
        m = chat.messages.add(role=rng.choice(ROLES), content=rng.choice(CONTENTS))
        if rng.random() < 0.4:
            m.tool_calls.extend(rng.choice(CALLS))
        if rng.random() < 0.3:
            m.tool_call_id = "c1"
        if rng.random() < 0.2:
            m.name = "get_weather"
    return chat


def test_the_gateway_refuses_the_chats_with_tools_the_worker_refuses() -> None:
    rng = random.Random(27)
    refused = 0
    for _ in range(2000):
        chat = _random_chat(rng)
        try:
            prompt_from_proto(pb.Prompt(chat=chat))
            worker = None
        except ValueError as e:
            worker = str(e)
        try:
            validate_chat(chat)
            gateway = None
        except RequestError as e:
            gateway = e.message
        assert (gateway is None) == (worker is None), (str(chat)[:400], gateway, worker)
        refused += gateway is not None
    assert 300 < refused < 1900  # both outcomes were tried


def test_check_tools_normalizes_and_names_the_field() -> None:
    (tool,) = check_tools([{**WEATHER, "function": {**WEATHER["function"], "strict": True}}])
    assert tool == WEATHER  # strict is checked, not rendered
    with pytest.raises(ValueError, match=r"tools\[1\].function.name 'get_weather' is given twice"):
        check_tools([WEATHER, WEATHER])
    with pytest.raises(ValueError, match=r"tools must be a JSON array"):
        check_tools(WEATHER)


def test_tool_call_from_openai_takes_text_or_dict_arguments() -> None:
    fn = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    call = ToolCall.from_openai({"id": "c1", "type": "function", "function": fn}, "m")
    assert call == ToolCall("c1", "get_weather", '{"city": "Paris"}')
    as_dict = ToolCall.from_openai({"id": "c1", "function": {"name": "f", "arguments": {"a": 1}}}, "m")
    assert as_dict.parsed_arguments() == {"a": 1}
    with pytest.raises(ValueError, match=r"m.arguments is not valid JSON"):
        ToolCall.from_openai({"function": {"name": "f", "arguments": "{"}}, "m")


def test_hermes_rewrite_writes_tools_calls_and_results_like_qwen() -> None:
    call = ToolCall("c1", "get_weather", '{"city": "Paris"}').hf("m")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call, call]},
        {"role": "tool", "content": "22 C", "tool_call_id": "c1"},
        {"role": "tool", "content": "25 C", "tool_call_id": "c2"},
        {"role": "user", "content": "Thanks"},
    ]
    out = hermes_messages(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "user"]
    assert all(set(m) == {"role", "content"} for m in out)
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in system
    assert system.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert tool_call_text("get_weather", {"city": "Paris"}) == block
    assert out[2]["content"] == f"Let me look.\n{block}\n{block}"
    assert out[3]["content"] == "<tool_response>\n22 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>"
    # no system message: one is added; no tools: none is
    assert hermes_messages(messages[1:], [WEATHER])[0]["content"].startswith("# Tools\n")
    assert hermes_messages(messages[1:], [])[0] == {"role": "user", "content": "Weather in Paris and Rome?"}
