"""Engine outputs to gRPC messages (``worker/serving/proto_convert.py``): a speculating request's
deltas carry its cumulative counters in ``TokenDelta.speculation``, its finished event the
totals in ``Usage``, and a request that does not speculate carries neither; the gateway's
metrics read what the worker writes. Speculation options map onto SamplingParams. Structured
output: each constraint kind maps onto ``SamplingParams.constraint`` (a malformed one is a
ValueError naming it), the grammar's refused drafts and an unfinished constraint reach the
events, and chat tools (tools_json, tool calls, tool results) reach the ``ChatPrompt``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from draftwise.gateway.metrics import GatewayMetrics
from draftwise.gateway.streams import merge_delta
from draftwise.v1 import generation_pb2 as pb
from draftwise.worker.core.outputs import CompletionOutput, RequestDelta, RequestMetrics, RequestOutput, SpecStats
from draftwise.worker.sampling.constraints import Constraint
from draftwise.worker.serving.proto_convert import (
    continuation_from_proto,
    events_from_delta,
    finished_from_delta,
    prompt_from_proto,
    responses_from_delta,
    sampling_params_from_proto,
)
from draftwise.worker.text.chat import ChatPrompt
from draftwise.worker.text.chat_tools import ToolCall


def _final(spec: SpecStats | None, tokens: list[int], finish: str = "length") -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt="p",
        prompt_token_ids=[1, 2, 3],
        outputs=[CompletionOutput(0, "text", tokens, None, finish, None, spec)],
        finished=True,
        metrics=RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finish_time=12.0),
    )


def _delta(spec: SpecStats | None, tokens: list[int], first: int = 0, final: RequestOutput | None = None):
    return RequestDelta(
        request_id="r",
        token_ids=tokens,
        first_token_index=first,
        text="x" * len(tokens),
        logprobs=None,
        finished=final is not None,
        finish_reason=None if final is None else final.outputs[0].finish_reason,
        final=final,
        spec=spec,
    )


def test_delta_carries_the_speculation_counters():
    (ev,) = events_from_delta(_delta(SpecStats(proposed=8, accepted=6, verify_steps=2), [5, 6, 7], first=4))
    d = ev.delta
    assert list(d.token_ids) == [5, 6, 7] and d.first_token_index == 4
    assert d.HasField("speculation")
    s = d.speculation
    assert (s.proposed_tokens, s.accepted_tokens, s.verify_steps) == (8, 6, 2)
    assert s.acceptance_rate == pytest.approx(0.75)
    assert s.mean_accepted_length == pytest.approx(4.0)  # 1 + 6 / 2


def test_zero_counters_are_present_not_unset():
    """A speculating request before its first verification: present, all zeros (unset
    means "does not speculate")."""
    (ev,) = events_from_delta(_delta(SpecStats(0, 0, 0), [9]))
    assert ev.delta.HasField("speculation")
    s = ev.delta.speculation
    assert (s.proposed_tokens, s.accepted_tokens, s.verify_steps) == (0, 0, 0)
    assert s.acceptance_rate == 0.0 and s.mean_accepted_length == 0.0
    # and on the wire too
    again = pb.GenerationEvent.FromString(ev.SerializeToString())
    assert again.delta.HasField("speculation")


def test_no_speculation_no_counters():
    final = _final(None, [1, 2])
    delta_ev, fin_ev = events_from_delta(_delta(None, [2], first=1, final=final))
    assert not delta_ev.delta.HasField("speculation")
    u = fin_ev.finished.usage
    assert (u.prompt_tokens, u.completion_tokens) == (3, 2)
    assert u.speculative_proposed_tokens == 0 and u.speculative_accepted_tokens == 0


def test_finished_usage_equals_the_last_deltas_counters():
    spec = SpecStats(proposed=12, accepted=5, verify_steps=4)
    final = _final(spec, [4, 5, 6, 7, 8])
    delta_ev, fin_ev = events_from_delta(_delta(spec, [7, 8], first=3, final=final))
    assert fin_ev.WhichOneof("kind") == "finished"
    f = fin_ev.finished
    assert f.finish_reason == pb.FINISH_REASON_LENGTH
    assert (f.usage.prompt_tokens, f.usage.completion_tokens) == (3, 5)
    assert f.usage.speculative_proposed_tokens == delta_ev.delta.speculation.proposed_tokens == 12
    assert f.usage.speculative_accepted_tokens == delta_ev.delta.speculation.accepted_tokens == 5
    assert f.timings.queue_ms == pytest.approx(500) and f.timings.total_ms == pytest.approx(2000)


def test_finished_usage_reports_the_cached_prompt_tokens():
    """RequestOutput.num_cached_tokens -> Usage.cached_prompt_tokens (never past the prompt: a
    continuation's cached tokens may include output tokens)."""
    final = _final(None, [4, 5])

    def cached(n: int) -> int:
        out = dataclasses.replace(final, num_cached_tokens=n)
        return finished_from_delta(_delta(None, [5], first=1, final=out)).usage.cached_prompt_tokens

    assert (cached(0), cached(2), cached(5)) == (0, 2, 3)


def test_a_final_delta_without_tokens_still_reports_usage():
    """An abort's final delta has no tokens: no delta event, the totals go in Finished."""
    spec = SpecStats(proposed=3, accepted=1, verify_steps=1)
    final = _final(spec, [4, 5], finish="abort")
    (ev,) = events_from_delta(_delta(spec, [], first=2, final=final))
    assert ev.finished.finish_reason == pb.FINISH_REASON_ABORT
    assert (ev.finished.usage.speculative_proposed_tokens, ev.finished.usage.speculative_accepted_tokens) == (3, 1)
    assert finished_from_delta(_delta(spec, [], first=2, final=final)) == ev.finished


def test_worker_responses_match_events():
    spec = SpecStats(proposed=4, accepted=4, verify_steps=1)
    d = _delta(spec, [1, 2, 3, 4, 5], final=_final(spec, [1, 2, 3, 4, 5]))
    assert [r.event for r in responses_from_delta(d)] == events_from_delta(d)


def test_gateway_reads_what_the_worker_writes():
    """The gateway's coalescing keeps the latest counters, and its metrics count Usage."""
    first = events_from_delta(_delta(SpecStats(4, 3, 1), [1, 2, 3, 4]))[0].delta
    second = events_from_delta(_delta(SpecStats(8, 5, 2), [5, 6, 7], first=4))[0].delta
    merge_delta(first, second)
    assert list(first.token_ids) == [1, 2, 3, 4, 5, 6, 7]
    assert (first.speculation.proposed_tokens, first.speculation.accepted_tokens) == (8, 5)

    metrics = GatewayMetrics()
    spec = SpecStats(proposed=10, accepted=4, verify_steps=3)
    (fin,) = events_from_delta(_delta(spec, [], first=7, final=_final(spec, list(range(7)))))
    metrics.observe_finished(fin.finished)
    (plain,) = events_from_delta(_delta(None, [], first=7, final=_final(None, list(range(7)))))
    metrics.observe_finished(plain.finished)
    r = metrics.registry
    assert r.get_sample_value("draftwise_spec_decode_proposed_tokens_total") == 10
    assert r.get_sample_value("draftwise_spec_decode_accepted_tokens_total") == 4
    assert r.get_sample_value("draftwise_spec_decode_acceptance_rate_count") == 1  # the plain request is not counted
    assert r.get_sample_value("draftwise_spec_decode_acceptance_rate_sum") == pytest.approx(0.4)


def test_speculation_options_map_onto_sampling_params():
    plain = pb.SamplingParams(temperature=0)
    p = sampling_params_from_proto(plain)
    assert p.use_speculation and p.max_speculative_tokens is None
    p = sampling_params_from_proto(plain, pb.SpeculationOptions())  # all unset: the server's configuration
    assert p.use_speculation and p.max_speculative_tokens is None
    p = sampling_params_from_proto(plain, pb.SpeculationOptions(enabled=False))
    assert not p.use_speculation
    p = sampling_params_from_proto(plain, pb.SpeculationOptions(enabled=True, max_speculative_tokens=2))
    assert p.use_speculation and p.max_speculative_tokens == 2
    with pytest.raises(ValueError, match="max_speculative_tokens must be >= 1"):
        sampling_params_from_proto(plain, pb.SpeculationOptions(max_speculative_tokens=0))
    p = sampling_params_from_proto(plain, pb.SpeculationOptions(methods=["suffix", "draft", "suffix"]))
    assert p.speculative_methods == ("suffix", "draft")
    assert sampling_params_from_proto(plain, pb.SpeculationOptions()).speculative_methods is None
    with pytest.raises(ValueError, match="speculative_methods: unknown method 'tree'"):
        sampling_params_from_proto(plain, pb.SpeculationOptions(methods=["tree"]))


# --- structured output and tools (issue 27) ---------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "want"),
    [
        (
            "json_schema",
            '{"type": "object", "required": ["a"]}',
            Constraint.json_schema({"type": "object", "required": ["a"]}),
        ),
        ("json_schema", "true", Constraint.json_schema(True)),
        ("json_object", True, Constraint.json_object()),
        ("regex", "[a-z]+@[a-z]+\\.com", Constraint.regex("[a-z]+@[a-z]+\\.com")),
        ("grammar", 'root ::= "yes" | "no"', Constraint.grammar('root ::= "yes" | "no"')),
        ("choice", pb.ChoiceConstraint(options=["red", "green"]), Constraint.choice(["red", "green"])),
    ],
)
def test_each_constraint_kind_maps_onto_sampling_params(field: str, value: object, want: Constraint) -> None:
    p = sampling_params_from_proto(pb.SamplingParams(temperature=0, **{field: value}))
    assert p.constraint == want
    assert sampling_params_from_proto(pb.SamplingParams(temperature=0)).constraint is None


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"json_schema": ""}, "json_schema constraint is empty"),
        ({"json_schema": "{not json"}, "json_schema constraint is not valid JSON"),
        ({"json_schema": "[1, 2]"}, "object or a boolean"),
        ({"json_schema": "[" * 100_000}, "json_schema"),
        ({"json_object": False}, "json_object must be true"),
        ({"regex": "   "}, "regex constraint is empty"),
        ({"grammar": "x" * (256 * 1024 + 1)}, "grammar constraint is larger than"),
        ({"choice": pb.ChoiceConstraint()}, "at least one string"),
        ({"choice": pb.ChoiceConstraint(options=["a", ""])}, "non-empty strings"),
        ({"choice": pb.ChoiceConstraint(options=["a"] * 1025)}, "at most 1024"),
        ({"regex": "a+", "ignore_eos": True}, "ignore_eos cannot be combined"),
        ({"json_object": True, "min_tokens": 1}, "min_tokens cannot be combined"),
    ],
)
def test_a_malformed_constraint_is_a_value_error_naming_it(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sampling_params_from_proto(pb.SamplingParams(**params))


def test_grammar_refused_drafts_are_reported_and_read_back_from_a_continuation() -> None:
    (ev,) = events_from_delta(_delta(SpecStats(proposed=9, accepted=4, verify_steps=3, grammar_refused=2), [5]))
    assert ev.delta.speculation.grammar_refused_tokens == 2
    (plain,) = events_from_delta(_delta(SpecStats(4, 2, 1), [5]))
    assert plain.delta.speculation.grammar_refused_tokens == 0
    start = pb.StartGeneration(continuation=pb.Continuation(output_token_ids=[1, 2], speculation=ev.delta.speculation))
    tokens, spec = continuation_from_proto(start)
    assert tokens == [1, 2] and spec == SpecStats(9, 4, 3, 2)


@pytest.mark.parametrize("unfinished", [True, False])
def test_constraint_unfinished_reaches_the_finished_event(unfinished: bool) -> None:
    final = _final(None, [4, 5])
    final = dataclasses.replace(
        final, outputs=[dataclasses.replace(final.outputs[0], constraint_unfinished=unfinished)]
    )
    (_, fin) = events_from_delta(_delta(None, [5], first=1, final=final))
    assert fin.finished.constraint_unfinished is unfinished
    assert fin.finished.finish_reason == pb.FINISH_REASON_LENGTH


TOOLS_JSON = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
)


def _chat(*messages: pb.ChatMessage, tools_json: str = TOOLS_JSON) -> pb.Prompt:
    return pb.Prompt(chat=pb.ChatMessages(messages=list(messages), tools_json=tools_json))


def test_chat_tools_map_onto_the_chat_prompt() -> None:
    call = pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    prompt = prompt_from_proto(
        _chat(
            pb.ChatMessage(role="user", content="Weather in Paris?"),
            pb.ChatMessage(role="assistant", tool_calls=[call]),
            pb.ChatMessage(role="tool", content="22 C", tool_call_id="call_1", name="get_weather"),
        )
    )
    assert isinstance(prompt, ChatPrompt)
    assert prompt.tools == tuple(json.loads(TOOLS_JSON))
    user, assistant, tool = prompt.messages
    assert (user.role, user.content, user.tool_calls) == ("user", "Weather in Paris?", ())
    assert assistant.tool_calls == (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)
    assert (tool.role, tool.content, tool.tool_call_id, tool.name) == ("tool", "22 C", "call_1", "get_weather")
    assert prompt.as_dicts()[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    plain = prompt_from_proto(_chat(pb.ChatMessage(role="user", content="hi"), tools_json=""))
    assert isinstance(plain, ChatPrompt) and plain.tools == () and not plain.uses_tools


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (_chat(pb.ChatMessage(role="user", content="x"), tools_json="{"), "tools_json is not valid JSON"),
        (
            _chat(pb.ChatMessage(role="user", content="x"), tools_json='{"type": "function"}'),
            "tools_json must be a JSON array",
        ),
        (
            _chat(pb.ChatMessage(role="user", content="x"), tools_json='[{"type": "retrieval"}]'),
            r"tools_json\[0\].type",
        ),
        (
            _chat(pb.ChatMessage(role="user", content="x"), tools_json='[{"type": "function", "function": {}}]'),
            r"tools_json\[0\].function.name",
        ),
        (_chat(pb.ChatMessage(role="tool", tool_call_id="c")), r"messages\[0\].content is empty"),
        (
            _chat(pb.ChatMessage(role="user", content="x", tool_calls=[pb.ToolCall(name="f")])),
            r"messages\[0\].tool_calls is set on a 'user' message",
        ),
        (
            _chat(pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", arguments="{}")])),
            r"messages\[0\].tool_calls\[0\].name is empty",
        ),
        (
            _chat(pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="f", arguments="[1]")])),
            r"messages\[0\].tool_calls\[0\].arguments must be a JSON object",
        ),
    ],
)
def test_malformed_chat_tools_are_a_value_error_naming_the_field(prompt: pb.Prompt, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prompt_from_proto(prompt)
