"""The Python client's structured output and chat tools (``clients/python/draftwise_client``):
each ``Constraint`` kind fills the request's constraint oneof as the worker reads it back, chat
messages with tool calls and tool results and the tools list reach the ChatMessages message the
worker renders, and the new counters and flag of the events reach the client's Delta and
Completion."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))
from draftwise_client import Constraint, SamplingParams  # noqa: E402
from draftwise_client._proto import generation_pb2 as cpb  # noqa: E402
from draftwise_client._types import Collector, chat_prompt, delta_from_event, start_message  # noqa: E402

from draftwise.v1 import generation_pb2 as pb  # noqa: E402
from draftwise.worker.sampling import constraints as worker  # noqa: E402
from draftwise.worker.serving.proto_convert import prompt_from_proto, sampling_params_from_proto  # noqa: E402
from draftwise.worker.text.chat import ChatPrompt  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    ("client", "want"),
    [
        (Constraint.json_schema(SCHEMA), worker.Constraint.json_schema(SCHEMA)),
        (Constraint.json_schema(json.dumps(SCHEMA)), worker.Constraint.json_schema(SCHEMA)),
        (Constraint.json_object(), worker.Constraint.json_object()),
        (Constraint.regex("[0-9]+"), worker.Constraint.regex("[0-9]+")),
        (Constraint.grammar('root ::= "a"+'), worker.Constraint.grammar('root ::= "a"+')),
        (Constraint.choice(["yes", "no"]), worker.Constraint.choice(["yes", "no"])),
    ],
)
def test_each_constraint_kind_reaches_the_worker_as_sent(client: Constraint, want: worker.Constraint) -> None:
    start = start_message("x", SamplingParams(temperature=0, constraint=client), "", "r")
    wire = pb.SamplingParams.FromString(start.sampling_params.SerializeToString())
    assert wire.WhichOneof("constraint") == client.kind
    assert sampling_params_from_proto(wire).constraint == want
    assert SamplingParams().to_proto().WhichOneof("constraint") is None


def test_choice_refuses_a_bare_string() -> None:
    with pytest.raises(ValueError, match="list of strings"):
        Constraint.choice("yes")


def test_chat_tools_reach_the_workers_chat_prompt() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "22 C"},
    ]
    prompt = chat_prompt(messages, [tool])
    got = prompt_from_proto(pb.Prompt.FromString(prompt.SerializeToString()))
    assert isinstance(got, ChatPrompt)
    assert got.tools == (tool,)
    assert got == ChatPrompt.from_messages(messages, [tool])
    assert not chat_prompt([{"role": "user", "content": "hi"}]).chat.tools_json
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\] must be a dict"):
        chat_prompt([{"role": "assistant", "tool_calls": ["get_weather"]}])


def test_the_counters_and_the_unfinished_flag_reach_delta_and_completion() -> None:
    delta = cpb.GenerationEvent(request_id="r", delta=cpb.TokenDelta(token_ids=[1, 2], text="{"))
    delta.delta.speculation.CopyFrom(
        cpb.SpeculationStats(proposed_tokens=8, accepted_tokens=2, grammar_refused_tokens=5)
    )
    finished = cpb.GenerationEvent(
        request_id="r",
        finished=cpb.Finished(finish_reason=cpb.FINISH_REASON_LENGTH, constraint_unfinished=True),
    )
    first, last = delta_from_event(delta), delta_from_event(finished)
    assert first.speculation is not None and first.speculation.grammar_refused_tokens == 5
    assert last.constraint_unfinished and not first.constraint_unfinished
    acc = Collector()
    acc.add(first)
    acc.add(last)
    done = acc.result()
    assert done.finish_reason == "length" and done.constraint_unfinished and done.text == "{"
