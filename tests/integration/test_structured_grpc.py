"""Structured output and chat tools over the wire: a real worker (the embedded default target with
a ChatML template, see tests/chat_model.py, speculating with the embedded draft model) behind a
real gateway, raw gRPC and the Python client.

- Each constraint kind gives output that matches it, token for token the same with speculation on
  and off; the grammar refuses drafts and says so (SpeculationStats.grammar_refused_tokens).
- A request that ends before its constraint is complete says so (Finished.constraint_unfinished):
  max_tokens, a stop string, a cancel.
- A malformed constraint is INVALID_ARGUMENT from the gateway (no worker sees it) and from the
  worker itself when sent to it directly; a constraint that does not compile is INVALID_ARGUMENT
  from the worker, naming the problem. The worker serves the next request after each.
- Chat with tools: the worker renders them Hermes-style (this template knows no tools), exactly
  as ``ChatTemplate`` renders them offline; malformed tools are INVALID_ARGUMENT at both hops.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import pytest

from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.v1 import worker_service_pb2_grpc as wgrpc
from tests.chat_model import make_chat_model
from tests.integration.procs import CLIENT_DIR, ENGINE_ARGS, PARENT, Proc, secret_args, start_gateway
from tests.integration.rpc import Result, cancel_req, run_stream, start, start_req, worker_metadata

sys.path.insert(0, str(CLIENT_DIR))
from draftwise_client import Client, Constraint, GenerationError, SamplingParams  # noqa: E402

K = 4
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'root ::= "yes" | "no" | "maybe"'
PROMPT = "Person record as JSON:"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CALL_REGEX = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,10}"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("structured-model") / "chatml")


@pytest.fixture(scope="module")
def procs(chat_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("structured-procs")
    args = ["-m", "draftwise.worker.serving.server", "--port=0", "--log-format=json", *PARENT, *secret_args()]
    args += [*ENGINE_ARGS, f"--model={chat_dir}", "--speculative-model=default", f"--num-speculative-tokens={K}"]
    args += ["--no-speculative-adaptive"]  # k = K every step: drafts every step, for the grammar to refuse
    worker = Proc("structured-worker", args, tmp).wait_ready()
    try:
        gateway = start_gateway([worker], tmp, "structured-gateway", "--resume-retention-s=0")
    except BaseException:
        worker.kill()
        raise
    yield worker, gateway
    gateway.stop()
    worker.stop()


def _stream(gateway: Proc, starts: list[pb.StartGeneration]) -> dict[str, Result]:
    async def main() -> dict[str, Result]:
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            return await run_stream(gsgrpc.GenerateServiceStub(ch), starts, timeout=300)

    return asyncio.run(main())


def _on_worker(worker: Proc, s: pb.StartGeneration) -> tuple[grpc.StatusCode, str, list[pb.GenerationEvent]]:
    """``s`` sent straight to the worker (no gateway check): the call's status and events."""

    async def main() -> tuple[grpc.StatusCode, str, list[pb.GenerationEvent]]:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            call = wgrpc.WorkerServiceStub(ch).Generate(
                wpb.WorkerServiceGenerateRequest(start=s), metadata=worker_metadata(), timeout=300
            )
            events = []
            try:
                async for resp in call:
                    events.append(resp.event)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or "", events
            return grpc.StatusCode.OK, "", events

    return asyncio.run(main())


def _constrained(rid: str, prompt: str = PROMPT, speculate: bool = True, **params: object) -> pb.StartGeneration:
    s = start(rid, prompt, temperature=0, **{"max_tokens": 64, **params})
    s.speculation.enabled = speculate
    return s


def _assert_served(worker: Proc, gateway: Proc, rid: str) -> None:
    """The worker is up and serves a constrained request, through the gateway and directly."""
    assert worker.popen.poll() is None, worker.log()[-3000:]
    (r,) = _stream(gateway, [_constrained(rid, choice=pb.ChoiceConstraint(options=CHOICES))]).values()
    assert r.kind == "finished" and r.text in CHOICES, r.final
    code, details, events = _on_worker(worker, _constrained(f"{rid}-direct", regex=REGEX))
    assert code == grpc.StatusCode.OK, details
    assert re.fullmatch(REGEX, "".join(e.delta.text for e in events if e.WhichOneof("kind") == "delta"))


# --- output that matches -----------------------------------------------------------------

KINDS: dict[str, dict[str, object]] = {
    "json_schema": {"json_schema": json.dumps(SCHEMA)},
    "json_object": {"json_object": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": pb.ChoiceConstraint(options=CHOICES)},
    "grammar": {"grammar": GRAMMAR},
}


def _matches(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return text in ("yes", "no", "maybe")


def test_each_kind_matches_and_speculation_changes_no_token(procs: tuple[Proc, Proc]) -> None:
    worker, gateway = procs
    starts = []
    for kind, params in KINDS.items():
        starts += [_constrained(f"{kind}-spec", **params), _constrained(f"{kind}-plain", speculate=False, **params)]
    results = _stream(gateway, starts)
    refused = proposed = 0
    for kind in KINDS:
        spec, plain = results[f"{kind}-spec"], results[f"{kind}-plain"]
        for r in (spec, plain):
            assert r.kind == "finished", r.final
            f = r.final.finished
            assert f.finish_reason == pb.FINISH_REASON_STOP and not f.constraint_unfinished, (kind, r.text, f)
            assert _matches(kind, r.text), (kind, r.text)
        assert spec.token_ids == plain.token_ids, kind  # greedy: exact under speculation
        proposed += spec.final.finished.usage.speculative_proposed_tokens
        assert plain.final.finished.usage.speculative_proposed_tokens == 0, kind
    assert proposed > 0
    # the counters ride on the deltas: read them from a direct worker call, which keeps every event
    for kind, params in KINDS.items():
        code, details, events = _on_worker(worker, _constrained(f"{kind}-counters", **params))
        assert code == grpc.StatusCode.OK, details
        stats = [
            e.delta.speculation for e in events if e.WhichOneof("kind") == "delta" and e.delta.HasField("speculation")
        ]
        assert stats, kind
        last = stats[-1]
        assert last.grammar_refused_tokens <= last.proposed_tokens - last.accepted_tokens, (kind, last)
        refused += last.grammar_refused_tokens
    # the draft model drafts under the grammar (Grammars.mask_draft): nothing it proposes is refused (n-gram's
    # refusals: tests/engine/test_structured_engine.py; the counter on the wire: tests/unit/test_proto_convert.py)
    assert refused == 0


def test_the_client_sends_each_kind_and_reads_the_counters(procs: tuple[Proc, Proc]) -> None:
    _, gateway = procs
    constraints = {
        "json_schema": Constraint.json_schema(SCHEMA),
        "json_object": Constraint.json_object(),
        "regex": Constraint.regex(REGEX),
        "choice": Constraint.choice(CHOICES),
        "grammar": Constraint.grammar(GRAMMAR),
    }
    with Client(gateway.address) as client:
        refused = 0
        for kind, c in constraints.items():
            deltas = list(client.generate(PROMPT, SamplingParams(max_tokens=64, temperature=0, constraint=c)))
            text = "".join(d.text for d in deltas)
            assert deltas[-1].finish_reason == "stop" and not deltas[-1].constraint_unfinished, (kind, text)
            assert _matches(kind, text), (kind, text)
            stats = [d.speculation for d in deltas if d.speculation is not None]
            assert stats, kind
            refused += stats[-1].grammar_refused_tokens
        assert refused == 0  # the draft model drafts under the grammar (the client reads the counter: it is 0)
        done = client.complete(
            PROMPT, SamplingParams(max_tokens=3, temperature=0, constraint=constraints["json_schema"])
        )
        assert done.finish_reason == "length" and done.constraint_unfinished
        with pytest.raises(GenerationError) as e:
            client.complete(PROMPT, SamplingParams(constraint=Constraint.regex("(")))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.message


# --- ending before the constraint is complete --------------------------------------------


def test_ending_early_says_the_constraint_is_unfinished(procs: tuple[Proc, Proc]) -> None:
    worker, gateway = procs
    results = _stream(
        gateway,
        [
            _constrained("length", max_tokens=3, json_schema=json.dumps(SCHEMA)),
            _constrained("stop-str", regex=REGEX, stop=["-"]),
            _constrained("complete", regex=REGEX),
        ],
    )
    length, stop, complete = results["length"], results["stop-str"], results["complete"]
    assert length.finish_reason == pb.FINISH_REASON_LENGTH and length.final.finished.constraint_unfinished
    assert len(length.token_ids) == 3
    assert stop.finish_reason == pb.FINISH_REASON_STOP and stop.final.finished.stop_str == "-"
    assert stop.final.finished.constraint_unfinished
    assert complete.finish_reason == pb.FINISH_REASON_STOP and not complete.final.finished.constraint_unfinished
    assert stop.text == complete.text.split("-")[0]


def test_a_cancelled_constrained_request_is_unfinished(procs: tuple[Proc, Proc]) -> None:
    _, gateway = procs

    async def main() -> pb.Finished:
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=120)
            # a JSON object with free-text values runs to max_tokens on this model
            s = _constrained("long", prompt="def fibonacci(n):", max_tokens=400, json_object=True)
            await call.write(start_req(s))
            async for resp in call:
                ev = resp.event
                if ev.WhichOneof("kind") == "delta":
                    await call.write(cancel_req("long"))
                    continue
                await call.done_writing()
                assert ev.WhichOneof("kind") == "finished", ev
                return ev.finished
            raise AssertionError("no final event")

    finished = asyncio.run(main())
    assert finished.finish_reason == pb.FINISH_REASON_ABORT and finished.constraint_unfinished


# --- refusals ----------------------------------------------------------------------------

MALFORMED = [
    ("json_schema", {"json_schema": "{not json"}, "json_schema"),
    ("json_schema-array", {"json_schema": "[1, 2]"}, "json_schema"),
    ("json_object", {"json_object": False}, "json_object"),
    ("regex", {"regex": ""}, "regex"),
    ("grammar", {"grammar": "   "}, "grammar"),
    ("choice", {"choice": pb.ChoiceConstraint()}, "choice"),
    ("choice-empty-option", {"choice": pb.ChoiceConstraint(options=["a", ""])}, "choice"),
    ("ignore_eos", {"regex": REGEX, "ignore_eos": True}, "ignore_eos"),
    ("min_tokens", {"regex": REGEX, "min_tokens": 2}, "min_tokens"),
]


def test_a_malformed_constraint_is_invalid_argument_at_both_hops(procs: tuple[Proc, Proc]) -> None:
    worker, gateway = procs
    results = _stream(gateway, [_constrained(rid, **params) for rid, params, _ in MALFORMED])
    for rid, _, field in MALFORMED:
        r = results[rid]
        assert r.code == grpc.StatusCode.INVALID_ARGUMENT and field in r.final.error.message, (rid, r.final)
    # no worker saw them: the gateway refused them; sent straight to the worker, it refuses them too
    for rid, params, field in MALFORMED:
        code, details, events = _on_worker(worker, _constrained(f"direct-{rid}", **params))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details and not events, (rid, code, details)
    _assert_served(worker, gateway, "after-malformed")


NOT_COMPILING = [
    ("regex-syntax", {"regex": "("}, r"regex constraint cannot be compiled"),
    ("grammar-syntax", {"grammar": 'root ::= ("a"'}, r"grammar constraint cannot be compiled"),
    ("grammar-no-root", {"grammar": 'start ::= "a"'}, r"grammar constraint"),
    ("schema-invalid", {"json_schema": '{"type": "no-such-type"}'}, r"JSON schema is invalid"),
]


def test_a_constraint_that_does_not_compile_is_invalid_argument_naming_it(procs: tuple[Proc, Proc]) -> None:
    worker, gateway = procs
    results = _stream(gateway, [_constrained(rid, **params) for rid, params, _ in NOT_COMPILING])
    for rid, _, pattern in NOT_COMPILING:
        r = results[rid]
        assert r.code == grpc.StatusCode.INVALID_ARGUMENT, (rid, r.final)
        assert re.search(pattern, r.final.error.message), (rid, r.final.error.message)
        assert not r.token_ids
    _assert_served(worker, gateway, "after-compile-errors")


# --- chat with tools ---------------------------------------------------------------------


def _tools_chat(rid: str, tools_json: str, **params: object) -> pb.StartGeneration:
    call = pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    chat = pb.ChatMessages(
        messages=[
            pb.ChatMessage(role="user", content="Weather in Paris?"),
            pb.ChatMessage(role="assistant", tool_calls=[call]),
            pb.ChatMessage(role="tool", content="22 C", tool_call_id="call_1", name="get_weather"),
            pb.ChatMessage(role="user", content="And in Rome?"),
        ],
        tools_json=tools_json,
    )
    s = start(rid, "x", temperature=0, **{"max_tokens": 64, **params})
    s.prompt.CopyFrom(pb.Prompt(chat=chat))
    return s


def test_chat_with_tools_renders_hermes_style_and_a_call_can_be_forced(
    procs: tuple[Proc, Proc], chat_dir: Path
) -> None:
    from draftwise.worker.text.chat import ChatPrompt, ChatTemplate
    from draftwise.worker.text.tokenizer import load_tokenizer

    worker, gateway = procs
    results = _stream(
        gateway,
        [
            _tools_chat("free", json.dumps([WEATHER])),
            _tools_chat("forced", json.dumps([WEATHER]), regex=TOOL_CALL_REGEX, max_tokens=200),
            _tools_chat("no-tools", ""),
        ],
    )
    template = ChatTemplate(load_tokenizer(chat_dir))
    for rid in ("free", "forced", "no-tools"):
        assert results[rid].kind == "finished", results[rid].final
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": "22 C", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "user", "content": "And in Rome?"},
    ]
    for rid, tools in (("free", [WEATHER]), ("no-tools", None)):
        want = template.encode(ChatPrompt.from_messages(msgs, tools), max_model_len=512, max_prompt_bytes=None)
        assert results[rid].final.finished.usage.prompt_tokens == len(want.token_ids), rid
        assert ("<tools>" in want.text) == (tools is not None)
    forced = results["forced"]
    assert forced.final.finished.finish_reason == pb.FINISH_REASON_STOP, forced.final
    call = json.loads(forced.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "get_weather" and isinstance(call["arguments"]["city"], str)


MALFORMED_TOOLS = [
    ("tools-not-json", _tools_chat("tools-not-json", "[{"), "tools_json is not valid JSON"),
    ("tools-not-array", _tools_chat("tools-not-array", json.dumps(WEATHER)), "tools_json must be a JSON array"),
    ("tools-no-name", _tools_chat("tools-no-name", '[{"type": "function", "function": {}}]'), "function.name"),
]


def test_malformed_tools_are_invalid_argument_at_both_hops(procs: tuple[Proc, Proc]) -> None:
    worker, gateway = procs
    bad_tool_msg = _tools_chat("tool-no-content", "")
    bad_tool_msg.prompt.chat.messages[2].content = ""
    cases = [*MALFORMED_TOOLS, ("tool-no-content", bad_tool_msg, r"messages[2].content is empty")]
    results = _stream(gateway, [s for _, s, _ in cases])
    for rid, s, needle in cases:
        r = results[rid]
        assert r.code == grpc.StatusCode.INVALID_ARGUMENT and needle in r.final.error.message, (rid, r.final)
        code, details, events = _on_worker(worker, s)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details and not events, (rid, details)
    _assert_served(worker, gateway, "after-bad-tools")
    with Client(gateway.address) as client:
        msgs = [{"role": "user", "content": "Weather in Rome?"}]
        deltas = list(
            client.chat(
                msgs,
                SamplingParams(max_tokens=200, temperature=0, constraint=Constraint.regex(TOOL_CALL_REGEX)),
                tools=[WEATHER],
            )
        )
        assert deltas[-1].finish_reason == "stop"
        assert re.fullmatch(TOOL_CALL_REGEX, "".join(d.text for d in deltas))


# --- metrics ---------------------------------------------------------------------------


def test_the_worker_and_the_gateway_count_constrained_work(procs: tuple[Proc, Proc]) -> None:
    """GetLoad reports constrained requests, compile and mask time and masked steps; the gateway
    exports them per worker (after its next load poll)."""
    import time

    from tests.integration.procs import metrics_port
    from tests.integration.rpc import scrape_metrics

    worker, gateway = procs

    async def load() -> wpb.GetLoadResponse:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            return await wgrpc.WorkerServiceStub(ch).GetLoad(wpb.GetLoadRequest(), metadata=worker_metadata())

    before = asyncio.run(load())
    schema = {"type": "object", "properties": {"metric_probe": {"type": "integer"}}, "required": ["metric_probe"]}
    results = _stream(gateway, [_constrained(f"m{i}", json_schema=json.dumps(schema)) for i in range(3)])
    assert all(r.kind == "finished" for r in results.values())
    after = asyncio.run(load())
    assert after.constrained_requests == before.constrained_requests + 3
    assert after.grammar_compile_seconds > before.grammar_compile_seconds  # a schema not seen before: compiled
    assert after.grammar_mask_seconds > before.grammar_mask_seconds
    assert after.grammar_masked_steps > before.grammar_masked_steps
    time.sleep(1.2)  # a round of load polls
    metrics = scrape_metrics(metrics_port(gateway))
    (requests,) = [v for k, v in metrics.items() if k.startswith("draftwise_constrained_requests_total{")]
    assert requests == after.constrained_requests
    (steps,) = [v for k, v in metrics.items() if k.startswith("draftwise_grammar_masked_steps_total{")]
    assert steps >= after.grammar_masked_steps
    assert [v for k, v in metrics.items() if k.startswith("draftwise_grammar_mask_seconds_total{")][0] > 0
    assert [v for k, v in metrics.items() if k.startswith("draftwise_grammar_compile_seconds_total{")][0] > 0
