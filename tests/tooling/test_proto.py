"""The gRPC contract: generated code is up to date, importable as ``draftwise.v1``, has the
right services and streaming kinds, round-trips every message, and passes ``buf``."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).parents[2]
PROTO = ROOT / "proto"
PKG = PROTO / "draftwise" / "v1"
BUF_MISSING = (
    "buf is not on PATH: install it with `npm install -g @bufbuild/buf` "
    "(or from https://github.com/bufbuild/buf/releases); set DRAFTWISE_REQUIRE_BUF=1 to fail instead"
)


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    """scripts/gen_proto.py as a module."""
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pb() -> dict[str, ModuleType]:
    """The generated modules, imported the way users import them."""
    names = ["generation_pb2", "generate_service_pb2", "generate_service_pb2_grpc"]
    names += ["worker_service_pb2", "worker_service_pb2_grpc"]
    return {n: importlib.import_module(f"draftwise.v1.{n}") for n in names}


def _require_buf() -> str:
    exe = shutil.which("buf")
    if exe is None:
        if os.environ.get("DRAFTWISE_REQUIRE_BUF"):
            pytest.fail(BUF_MISSING)
        pytest.skip(BUF_MISSING)
    return exe


# --- generated code is up to date -------------------------------------------------------


def test_generator_is_the_pinned_grpcio_tools(gen):
    assert gen.grpc_tools_version() == gen.GRPC_TOOLS_VERSION, (
        f"pip install grpcio-tools=={gen.GRPC_TOOLS_VERSION} (the [test] extra pins it)"
    )


def test_generated_code_is_up_to_date(gen, tmp_path):
    fresh = gen.generate(tmp_path)
    assert len(fresh) == 3 * len(gen.proto_files()) + 1, sorted(fresh)  # + the reflection set (.binpb)
    assert gen.differences(fresh, gen.committed()) == [], "run: python scripts/gen_proto.py"


def test_generation_is_stable(gen, tmp_path):
    assert gen.generate(tmp_path / "a") == gen.generate(tmp_path / "b")


def test_check_command_passes():
    res = subprocess.run(
        [sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_changed_proto_is_caught(gen, tmp_path):
    """What test_generated_code_is_up_to_date sees when a .proto changes without regenerating."""
    proto_root = tmp_path / "proto"
    shutil.copytree(PROTO, proto_root, ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
    source = proto_root / "draftwise" / "v1" / "generation.proto"
    text = source.read_text()
    changed = text.replace("  bool ignore_eos = 9;\n", "  bool ignore_eos = 9;\n  // New.\n  bool added = 99;\n")
    assert changed != text
    source.write_text(changed)
    diff = gen.differences(gen.generate(tmp_path / "out", proto_root), gen.committed())
    assert "out of date: generation_pb2.py" in diff and "out of date: generation_pb2.pyi" in diff, diff


# --- importable as draftwise.v1 ---------------------------------------------------------


def test_nothing_installs_a_top_level_proto_module():
    assert not (PROTO / "__init__.py").exists() and not (PROTO / "draftwise" / "__init__.py").exists()
    assert (PKG / "__init__.py").exists()
    for path in PKG.glob("*_pb2*.py"):
        imports = re.findall(r"^(?:from|import) \S+", path.read_text(), flags=re.M)
        local = [i for i in imports if "draftwise" in i or "proto" in i.split()[1].split(".")[0]]
        assert all(i == "from draftwise.v1" for i in local), (path.name, local)


def test_modules_import_as_draftwise_v1(pb):
    for name, module in pb.items():
        assert module.__name__ == f"draftwise.v1.{name}"
        assert Path(module.__file__).resolve().parent == PKG.resolve()


SERVICES = {
    # service: {method: (client_streaming, server_streaming, input, output)}
    "GenerateService": {
        "Generate": (True, True, "GenerateRequest", "GenerateResponse"),
        "GenerateStream": (False, True, "GenerateStreamRequest", "GenerateStreamResponse"),
        "ListModels": (False, False, "ListModelsRequest", "ListModelsResponse"),
    },
    "WorkerService": {
        "Generate": (False, True, "WorkerServiceGenerateRequest", "WorkerServiceGenerateResponse"),
        "GetLoad": (False, False, "GetLoadRequest", "GetLoadResponse"),
        "Drain": (False, False, "DrainRequest", "DrainResponse"),
    },
}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_services_and_streaming_kinds(pb, service):
    module = pb["generate_service_pb2" if service == "GenerateService" else "worker_service_pb2"]
    desc = module.DESCRIPTOR.services_by_name[service]
    assert desc.full_name == f"draftwise.v1.{service}"
    got = {
        m.name: (m.client_streaming, m.server_streaming, m.input_type.name, m.output_type.name) for m in desc.methods
    }
    assert got == SERVICES[service]
    grpc_module = pb[module.__name__.rsplit(".", 1)[1] + "_grpc"]
    for attr in [f"{service}Stub", f"{service}Servicer", f"add_{service}Servicer_to_server"]:
        assert hasattr(grpc_module, attr), attr
    for method in SERVICES[service]:
        assert callable(getattr(getattr(grpc_module, f"{service}Servicer"), method))


def test_unset_is_distinguishable_from_zero(pb):
    """The server applies vLLM defaults (temperature 1.0, top_p 1.0, max_tokens 16, ...) to unset fields."""
    fields = pb["generation_pb2"].SamplingParams.DESCRIPTOR.fields_by_name
    constraint = set(pb["generation_pb2"].SamplingParams.DESCRIPTOR.oneofs_by_name["constraint"].fields)
    with_presence = {name for name, f in fields.items() if f.has_presence and f not in constraint}
    assert with_presence == {
        "temperature",
        "top_p",
        "max_tokens",
        "seed",
        "repetition_penalty",
        "logprobs",
        "skip_special_tokens",
    }
    spec = pb["generation_pb2"].SpeculationOptions.DESCRIPTOR.fields_by_name
    assert spec["enabled"].has_presence and spec["max_speculative_tokens"].has_presence


def test_constraint_is_one_oneof(pb):
    """Structured output: at most one constraint kind per request, numbered as the contract says."""
    g = pb["generation_pb2"]
    oneof = g.SamplingParams.DESCRIPTOR.oneofs_by_name["constraint"]
    assert [(f.name, f.number) for f in oneof.fields] == [
        ("json_schema", 17),
        ("json_object", 18),
        ("regex", 19),
        ("grammar", 20),
        ("choice", 21),
    ]
    sp = _round_trip(g.SamplingParams(json_schema='{"type": "object"}'))
    assert sp.WhichOneof("constraint") == "json_schema"
    sp.regex = "[a-z]+"  # setting another kind replaces the first
    assert _round_trip(sp).WhichOneof("constraint") == "regex" and not sp.json_schema
    choice = _round_trip(g.SamplingParams(choice=g.ChoiceConstraint(options=["yes", "no"])))
    assert list(choice.choice.options) == ["yes", "no"]
    assert _round_trip(g.SamplingParams(json_object=False)).WhichOneof("constraint") == "json_object"
    assert _round_trip(g.SamplingParams()).WhichOneof("constraint") is None


def test_chat_tools_round_trip(pb):
    g = pb["generation_pb2"]
    call = g.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    chat = g.ChatMessages(
        messages=[
            g.ChatMessage(role="user", content="Weather in Paris?"),
            g.ChatMessage(role="assistant", tool_calls=[call]),
            g.ChatMessage(role="tool", content="22 C", tool_call_id="call_1", name="get_weather"),
        ],
        tools_json='[{"type": "function", "function": {"name": "get_weather"}}]',
    )
    copy = _round_trip(g.Prompt(chat=chat)).chat
    assert copy.messages[1].tool_calls[0] == call and copy.messages[2].tool_call_id == "call_1"
    assert copy.tools_json.startswith("[")


# --- every message round-trips ----------------------------------------------------------


def _round_trip(message):
    copy = type(message).FromString(message.SerializeToString())
    assert copy == message
    return copy


def _start(g: ModuleType):
    return g.StartGeneration(
        request_id="r-1",
        model="draftwise-target",
        prompt=g.Prompt(text="def fibonacci(n):"),
        sampling_params=g.SamplingParams(
            temperature=0.0,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            max_tokens=64,
            min_tokens=2,
            stop=["\n\n", "```"],
            stop_token_ids=[2, 7],
            ignore_eos=True,
            seed=-(2**63),
            presence_penalty=-0.5,
            frequency_penalty=0.5,
            repetition_penalty=1.1,
            logprobs=0,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        ),
        speculation=g.SpeculationOptions(enabled=False, max_speculative_tokens=3),
    )


def test_requests_round_trip(pb):
    g, svc, worker = pb["generation_pb2"], pb["generate_service_pb2"], pb["worker_service_pb2"]
    copy = _round_trip(svc.GenerateRequest(start=_start(g)))
    assert copy.WhichOneof("action") == "start"
    sp = copy.start.sampling_params
    assert sp.HasField("temperature") and sp.temperature == 0.0  # set to zero, not unset
    assert sp.HasField("logprobs") and sp.logprobs == 0
    assert copy.start.speculation.HasField("enabled") and not copy.start.speculation.enabled
    assert not _round_trip(g.SamplingParams()).HasField("temperature")

    tokens = _round_trip(
        svc.GenerateRequest(start=g.StartGeneration(prompt=g.Prompt(token_ids=g.TokenIds(ids=[1, 2]))))
    )
    assert tokens.start.prompt.WhichOneof("kind") == "token_ids" and list(tokens.start.prompt.token_ids.ids) == [1, 2]

    cancel = _round_trip(svc.GenerateRequest(cancel=g.CancelGeneration(request_id="r-1")))
    assert cancel.WhichOneof("action") == "cancel" and cancel.cancel.request_id == "r-1"

    _round_trip(svc.GenerateStreamRequest(start=_start(g)))
    _round_trip(worker.WorkerServiceGenerateRequest(start=_start(g)))
    _round_trip(svc.ListModelsRequest())
    _round_trip(worker.GetLoadRequest())
    assert _round_trip(worker.DrainRequest(wait=True)).wait


def _events(g: ModuleType) -> dict[str, object]:
    delta = g.TokenDelta(
        token_ids=[11, 12],
        text="x = 1",
        first_token_index=5,
        logprobs=[
            g.TokenLogprob(token_id=11, logprob=-0.25, rank=1, top_logprobs=[g.TopLogprob(token_id=11, logprob=-0.25)]),
            g.TokenLogprob(token_id=12, logprob=-2.5, rank=3, top_logprobs=[g.TopLogprob(token_id=9, logprob=-0.5)]),
        ],
        speculation=g.SpeculationStats(
            proposed_tokens=8,
            accepted_tokens=6,
            acceptance_rate=0.75,
            mean_accepted_length=4.0,
            verify_steps=2,
            grammar_refused_tokens=1,
        ),
    )
    usage = g.Usage(prompt_tokens=7, completion_tokens=16, speculative_proposed_tokens=8, speculative_accepted_tokens=6)
    timings = g.Timings(queue_ms=0.5, time_to_first_token_ms=12.25, total_ms=80.0)
    return {
        "delta": g.GenerationEvent(request_id="r-1", delta=delta),
        "finished": g.GenerationEvent(
            request_id="r-1",
            finished=g.Finished(finish_reason=g.FINISH_REASON_STOP, stop_str="\n\n", usage=usage, timings=timings),
        ),
        "finished_token": g.GenerationEvent(
            request_id="r-2", finished=g.Finished(finish_reason=g.FINISH_REASON_STOP, stop_token_id=2)
        ),
        "finished_length": g.GenerationEvent(
            request_id="r-3",
            finished=g.Finished(finish_reason=g.FINISH_REASON_LENGTH, usage=usage, constraint_unfinished=True),
        ),
        "error": g.GenerationEvent(
            request_id="r-4", error=g.RequestError(code=8, message="queue full: retry in a moment")
        ),
    }


def test_response_events_round_trip(pb):
    g, svc, worker = pb["generation_pb2"], pb["generate_service_pb2"], pb["worker_service_pb2"]
    for key, event in _events(g).items():
        for response in [svc.GenerateResponse, svc.GenerateStreamResponse, worker.WorkerServiceGenerateResponse]:
            copy = _round_trip(response(event=event)).event
            assert copy.WhichOneof("kind") == key.split("_")[0]
    events = _events(g)
    delta = _round_trip(events["delta"]).delta
    assert delta.first_token_index == 5 and delta.logprobs[1].rank == 3 and delta.speculation.verify_steps == 2
    assert delta.speculation.grammar_refused_tokens == 1
    assert _round_trip(events["finished_length"]).finished.constraint_unfinished
    assert not _round_trip(events["finished"]).finished.constraint_unfinished
    assert _round_trip(events["finished"]).finished.WhichOneof("stop_reason") == "stop_str"
    assert _round_trip(events["finished_token"]).finished.WhichOneof("stop_reason") == "stop_token_id"
    assert _round_trip(events["finished_length"]).finished.WhichOneof("stop_reason") is None
    assert g.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
    assert [g.FinishReason.Name(v) for v in (1, 2, 3)] == [
        "FINISH_REASON_STOP",
        "FINISH_REASON_LENGTH",
        "FINISH_REASON_ABORT",
    ]


def test_unary_responses_round_trip(pb):
    svc, worker = pb["generate_service_pb2"], pb["worker_service_pb2"]
    models = svc.ListModelsResponse(
        models=[
            svc.ModelInfo(
                name="draftwise-target",
                max_model_len=2048,
                has_draft=True,
                speculative_method=svc.SPECULATIVE_METHOD_DRAFT_MODEL,
                draft_model="draftwise-draft",
                num_speculative_tokens=4,
            ),
            svc.ModelInfo(name="plain", max_model_len=512),
            svc.ModelInfo(
                name="with-head",
                max_model_len=2048,
                has_draft=True,
                speculative_method=svc.SPECULATIVE_METHOD_EAGLE,
                draft_model="shipped",
                num_speculative_tokens=5,
            ),
        ],
        default_model="draftwise-target",
    )
    copy = _round_trip(models)
    assert copy.models[1].speculative_method == svc.SPECULATIVE_METHOD_UNSPECIFIED
    assert (copy.models[2].speculative_method, copy.models[2].draft_model) == (svc.SPECULATIVE_METHOD_EAGLE, "shipped")
    # values are the contract: appended, never renumbered (buf breaking guards the released ones)
    assert [(v.name, v.number) for v in svc.SpeculativeMethod.DESCRIPTOR.values] == [
        ("SPECULATIVE_METHOD_UNSPECIFIED", 0),
        ("SPECULATIVE_METHOD_DRAFT_MODEL", 1),
        ("SPECULATIVE_METHOD_NGRAM", 2),
        ("SPECULATIVE_METHOD_EAGLE", 3),
        ("SPECULATIVE_METHOD_MEDUSA", 4),
        ("SPECULATIVE_METHOD_SUFFIX", 5),
    ]
    _round_trip(
        worker.GetLoadResponse(
            model="draftwise-target",
            num_requests_running=3,
            num_requests_waiting=1,
            num_free_kv_blocks=100,
            num_total_kv_blocks=512,
            tokens_per_second=850.5,
            draining=True,
        )
    )
    _round_trip(worker.DrainResponse(num_requests_in_flight=2))


# --- buf --------------------------------------------------------------------------------


def test_buf_lint():
    buf = _require_buf()
    res = subprocess.run([buf, "lint"], cwd=PROTO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_buf_format():
    buf = _require_buf()
    res = subprocess.run(
        [buf, "format", "--diff", "--exit-code"], cwd=PROTO, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, "run `buf format -w` in proto/:\n" + res.stdout + res.stderr


# `buf generate` (Python, Go and TypeScript) against the committed code: tests/tooling/test_generated_clients.py
