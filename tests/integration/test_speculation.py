"""Speculative decoding served end to end: ``draftwise serve`` passes the speculation flags
on to its worker; greedy output is token for token what plain decoding gives; every delta
of a speculating request carries cumulative counters (``TokenDelta.speculation``), its
Finished event the totals (``Usage``), which the gateway's metrics count; per-request
``SpeculationOptions`` turn speculation off or cap k, and a bad one is INVALID_ARGUMENT;
a bad combination of flags ends ``draftwise serve`` with the worker's error, not a hang.
ListModels names the drafter: the draft model, or an EAGLE or Medusa head (checked without a
server: a worker's GetLoad metadata polled by a real Router)."""

from __future__ import annotations

import asyncio
import re
import selectors
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from draftwise.gateway.metrics import GatewayMetrics
from draftwise.gateway.router import Router, WorkerHandle
from draftwise.gateway.service import _model_info
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.worker import SamplingParams
from draftwise.worker.serving.server import WorkerServicer, draft_model_name
from tests.integration.conftest import reference_outputs
from tests.integration.procs import CLIENT_DIR, ENGINE_ARGS, MODEL_NAME, child_env, said
from tests.integration.prompts import BASES
from tests.integration.rpc import Result, start, start_req

LISTENING = re.compile(
    r"^draftwise serving (\S+) on 127\.0\.0\.1:(\d+) \(1 worker, speculative decoding: (?:(?:draft|eagle|medusa) \S+|ngram) k<=\d+; "
    r"metrics on http://127\.0\.0\.1:(\d+)/metrics\); "
    r"Ctrl-C stops$"
)
MAX_TOKENS = 32
K = 4  # --num-speculative-tokens of the draft-model server


class Serve:
    """``draftwise serve`` with one worker, a gRPC port and a metrics port, both free ones."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        self.log_path = tmp / "serve.log"
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "draftwise.cli", "serve", "--workers=1", "--port=0", "--metrics-port=0"]
                + ["--log-format=json", *ENGINE_ARGS, *flags],
                stdout=subprocess.PIPE,
                stderr=log,
                env=child_env(),
                cwd=tmp,
                text=True,
            )
        sel = selectors.DefaultSelector()
        sel.register(self.popen.stdout, selectors.EVENT_READ)
        line = self.popen.stdout.readline().rstrip("\n") if sel.select(180) else ""
        m = LISTENING.match(said(line)) if line else None
        if not m:
            self.close()
            raise AssertionError(f"draftwise serve did not start: {line!r}\n{self.log_path.read_text()[-4000:]}")
        self.model, self.address, self.metrics_port = m.group(1), f"127.0.0.1:{m.group(2)}", int(m.group(3))

    def scrape(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()  # workers are stopped by serve (and exit by themselves if it dies)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


@dataclass
class Run:
    """One request as a client saw it: its events, and the speculation counters of each delta."""

    result: Result
    spec: list[pb.SpeculationStats | None] = field(default_factory=list)  # per delta; None where unset

    @property
    def usage(self) -> pb.Usage:
        assert self.result.kind == "finished", self.result.final
        return self.result.final.finished.usage


def spec_start(rid: str, prompt: str, spec: pb.SpeculationOptions | None = None, **params: object):
    s = start(rid, prompt, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0, **params)
    if spec is not None:
        s.speculation.CopyFrom(spec)
    return s


async def _stream(address: str, starts: list[pb.StartGeneration]) -> dict[str, Run]:
    async with grpc.aio.insecure_channel(address) as ch:
        call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=120)
        for s in starts:
            await call.write(start_req(s))
        await call.done_writing()
        runs: dict[str, Run] = {}
        async for resp in call:
            ev = resp.event
            run = runs.setdefault(ev.request_id, Run(Result(ev.request_id)))
            run.result.add(ev)
            if ev.WhichOneof("kind") == "delta":
                run.spec.append(ev.delta.speculation if ev.delta.HasField("speculation") else None)
        assert await call.code() == grpc.StatusCode.OK
        return runs


def stream(address: str, starts: list[pb.StartGeneration]) -> dict[str, Run]:
    return asyncio.run(_stream(address, starts))


def reference_tokens(llm, prompts: list[str]) -> list[list[int]]:
    outs = reference_outputs(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def assert_cumulative(run: Run) -> pb.SpeculationStats:
    """Counters on every delta, never decreasing, consistent; returns the last."""
    assert run.spec and all(s is not None for s in run.spec), f"{run.result.request_id}: a delta without counters"
    prev = (0, 0, 0)
    for s in run.spec:
        now = (s.proposed_tokens, s.accepted_tokens, s.verify_steps)
        assert all(b >= a for a, b in zip(prev, now, strict=True)), f"counters went back: {prev} -> {now}"
        assert s.accepted_tokens <= s.proposed_tokens
        if s.proposed_tokens:
            assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.proposed_tokens)
        if s.verify_steps:
            assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.verify_steps)
        prev = now
    last = run.spec[-1]
    assert (run.usage.speculative_proposed_tokens, run.usage.speculative_accepted_tokens) == (
        last.proposed_tokens,
        last.accepted_tokens,
    )
    return last


# --- the draft model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    # not adaptive: k is exactly K every step, so that the counters are predictable (the
    # adaptive policy may, on a CPU where drafting does not pay, choose k = 0)
    s = Serve(
        tmp_path_factory.mktemp("spec-draft"),
        "--speculative-model=default",
        f"--num-speculative-tokens={K}",
        "--no-speculative-adaptive",
    )
    yield s
    s.close()


PROMPTS = BASES[:3]


@pytest.fixture(scope="module")
def draft_runs(draft_server: Serve) -> tuple[dict[str, Run], dict[str, float], dict[str, float]]:
    """One stream: three speculating requests, one with speculation off, one capped at k = 1,
    one with an invalid cap, one naming the draft model, one naming only methods the server
    does not run and one naming an unknown method; the gateway's metrics before and after."""
    starts = [spec_start(f"s{i}", p) for i, p in enumerate(PROMPTS)]
    starts += [
        spec_start("off", PROMPTS[0], pb.SpeculationOptions(enabled=False)),
        spec_start("k1", PROMPTS[1], pb.SpeculationOptions(enabled=True, max_speculative_tokens=1)),
        spec_start("bad", PROMPTS[2], pb.SpeculationOptions(max_speculative_tokens=0)),
        spec_start("only-draft", PROMPTS[2], pb.SpeculationOptions(methods=["draft"])),
        spec_start("only-ngram", PROMPTS[0], pb.SpeculationOptions(methods=["ngram", "suffix"])),
        spec_start("bad-method", PROMPTS[1], pb.SpeculationOptions(methods=["draft", "tree"])),
    ]
    before = draft_server.scrape()
    runs = stream(draft_server.address, starts)
    after = draft_server.scrape()
    return runs, before, after


def test_greedy_output_equals_plain_decoding(draft_server, draft_runs, reference_llm):
    assert draft_server.model == MODEL_NAME
    runs, _, _ = draft_runs
    ref = reference_tokens(reference_llm, PROMPTS)
    for i, want in enumerate(ref):
        r = runs[f"s{i}"].result
        assert r.finish_reason == pb.FINISH_REASON_LENGTH
        assert r.token_ids == want, f"s{i}: speculation changed the greedy output"
    assert runs["off"].result.token_ids == ref[0]
    assert runs["k1"].result.token_ids == ref[1]
    assert runs["only-draft"].result.token_ids == ref[2]
    assert runs["only-ngram"].result.token_ids == ref[0]


def test_list_models_reports_the_draft(draft_server, draft_runs):
    async def go():
        async with grpc.aio.insecure_channel(draft_server.address) as ch:
            return await gsgrpc.GenerateServiceStub(ch).ListModels(gspb.ListModelsRequest(), timeout=30)

    (info,) = asyncio.run(go()).models
    assert info.name == MODEL_NAME
    assert info.has_draft
    assert info.speculative_method == gspb.SPECULATIVE_METHOD_DRAFT_MODEL
    assert info.draft_model == "draftwise-draft"
    assert info.num_speculative_tokens == K


# --- ListModels for EAGLE and Medusa heads, without a server ---------------------------------


class _GetLoadCall:
    """A GetLoad call that answers ``load`` with ``trailing`` metadata."""

    def __init__(self, load: wpb.GetLoadResponse, trailing: tuple[tuple[str, str], ...]) -> None:
        self.load, self.trailing = load, trailing

    def __await__(self):
        return self._answer().__await__()

    async def _answer(self) -> wpb.GetLoadResponse:
        return self.load

    async def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.trailing


def _listed(method: str, model: str | None, head_folder: Path | None, k: int = 5) -> gspb.ModelInfo:
    """What ListModels says of a worker whose engine speculates with ``method``: the worker's
    GetLoad metadata (a servicer around a stand-in engine), polled by a real Router, reported
    by the gateway's ``_model_info``."""
    head = SimpleNamespace(folder=head_folder) if head_folder is not None else None
    proposer = SimpleNamespace(head=head) if head is not None else SimpleNamespace()  # a draft model's has none
    proposer.parts = (proposer,)
    servicer = WorkerServicer.__new__(WorkerServicer)  # no engine thread: only its metadata is read
    servicer.engine = SimpleNamespace(
        max_model_len=2048,
        spec_method=method,
        config=SimpleNamespace(spec_k=k, speculative_model=model),
        spec=SimpleNamespace(proposer=proposer),
    )
    trailing = servicer._model_metadata
    load = wpb.GetLoadResponse(model="m", num_total_kv_blocks=8, num_free_kv_blocks=8)

    async def poll() -> gspb.ModelInfo:
        router = Router(("127.0.0.1:1",), GatewayMetrics())
        try:
            (w,) = router.workers
            w.get_load = lambda *a, **kw: _GetLoadCall(load, trailing)
            await router._poll_once(w)
            ((name, handle),) = router.model_infos().items()
            return _model_info(name, handle)
        finally:
            await router.close()

    return asyncio.run(poll())


@pytest.mark.parametrize(
    ("method", "model", "head_folder", "name", "enum"),
    [
        # the head shipped for the target (speculative_model None): the folder the engine loaded
        ("eagle", None, Path("/pkg/heads/smollm2-135m-eagle"), "smollm2-135m-eagle", gspb.SPECULATIVE_METHOD_EAGLE),
        ("medusa", None, Path("/pkg/heads/smollm2-135m-medusa"), "smollm2-135m-medusa", gspb.SPECULATIVE_METHOD_MEDUSA),
        # shipped, its folder not known: "shipped"
        ("eagle", None, None, "shipped", gspb.SPECULATIVE_METHOD_EAGLE),
        ("medusa", "default", None, "shipped", gspb.SPECULATIVE_METHOD_MEDUSA),
        # a head folder given: its name
        ("eagle", "/data/heads/my-eagle", Path("/data/heads/my-eagle"), "my-eagle", gspb.SPECULATIVE_METHOD_EAGLE),
        ("medusa", "/data/heads/my-medusa", None, "my-medusa", gspb.SPECULATIVE_METHOD_MEDUSA),
        # the draft model, as before
        ("draft", "default", None, "draftwise-draft", gspb.SPECULATIVE_METHOD_DRAFT_MODEL),
        ("draft", "/data/my-draft", None, "my-draft", gspb.SPECULATIVE_METHOD_DRAFT_MODEL),
        # a hybrid is reported by its model drafter
        ("draft+suffix", "default", None, "draftwise-draft", gspb.SPECULATIVE_METHOD_DRAFT_MODEL),
        ("medusa+ngram", None, Path("/pkg/heads/m"), "m", gspb.SPECULATIVE_METHOD_MEDUSA),
    ],
)
def test_list_models_reports_the_head(method, model, head_folder, name, enum):
    info = _listed(method, model, head_folder)
    assert (info.name, info.max_model_len, info.has_draft) == ("m", 2048, True)
    assert (info.speculative_method, info.draft_model, info.num_speculative_tokens) == (enum, name, 5)
    sys.path.insert(0, str(CLIENT_DIR))
    from draftwise_client import ModelInfo

    client_info = ModelInfo.from_proto(info)
    assert (client_info.speculative_method, client_info.draft_model) == (method.split("+")[0], name)


@pytest.mark.parametrize(
    ("method", "enum"), [("ngram", gspb.SPECULATIVE_METHOD_NGRAM), ("suffix", gspb.SPECULATIVE_METHOD_SUFFIX)]
)
def test_list_models_without_a_named_drafter(method, enum):
    info = _listed(method, None, None, k=3)
    assert (info.has_draft, info.speculative_method, info.draft_model, info.num_speculative_tokens) == (
        True,
        enum,
        "",
        3,
    )
    sys.path.insert(0, str(CLIENT_DIR))
    from draftwise_client import ModelInfo

    client_info = ModelInfo.from_proto(info)
    assert (client_info.has_draft, client_info.speculative_method, client_info.draft_model) == (True, method, "")
    stale = WorkerHandle("w", "127.0.0.1:1", None, None, None, max_model_len=64, speculative_method=method)
    stale.draft_model = "leftover"  # a name never goes out with a method that has none
    assert _model_info("m", stale).draft_model == ""
    for method in ("", "some-future-method"):  # none, or one this gateway does not know: no speculation
        w = WorkerHandle("w", "127.0.0.1:1", None, None, None, max_model_len=64, speculative_method=method)
        w.draft_model, w.num_speculative_tokens = "x", 4
        info = _model_info("m", w)
        assert (info.has_draft, info.speculative_method, info.draft_model, info.num_speculative_tokens) == (
            False,
            gspb.SPECULATIVE_METHOD_UNSPECIFIED,
            "",
            0,
        )
    assert draft_model_name(None) == draft_model_name("default") == "draftwise-draft"
    assert draft_model_name(None, "eagle") == "shipped"


def test_python_client_speculation_options_and_stats(draft_server, reference_llm):
    sys.path.insert(0, str(CLIENT_DIR))
    from draftwise_client import Client
    from draftwise_client import SamplingParams as ClientParams

    with Client(draft_server.address) as client:
        (info,) = client.list_models()
        assert (info.has_draft, info.speculative_method, info.draft_model, info.num_speculative_tokens) == (
            True,
            "draft",
            "draftwise-draft",
            K,
        )
        base = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        on = list(client.generate(PROMPTS[0], ClientParams(**base)))
        capped = list(client.generate(PROMPTS[0], ClientParams(**base, max_speculative_tokens=1)))
        off = list(client.generate(PROMPTS[0], ClientParams(**base, speculation=False)))
        unserved = list(client.generate(PROMPTS[0], ClientParams(**base, speculative_methods=("suffix",))))
    want = reference_tokens(reference_llm, PROMPTS[:1])[0]
    for deltas in (on, capped, off, unserved):
        assert [t for d in deltas for t in d.token_ids] == want
    stats = [d.speculation for d in on if d.token_ids]
    assert all(st is not None for st in stats) and stats[-1].proposed_tokens > 0
    assert on[-1].usage.speculative_proposed_tokens == stats[-1].proposed_tokens
    last = [d.speculation for d in capped if d.speculation is not None][-1]
    assert 0 < last.proposed_tokens <= last.verify_steps  # k <= 1
    assert all(d.speculation is None for d in off) and off[-1].usage.speculative_proposed_tokens == 0
    assert all(d.speculation is None for d in unserved)  # the server runs a draft model, not the suffix cache


def test_counters_are_cumulative_and_match_usage(draft_runs):
    runs, _, _ = draft_runs
    for i in range(len(PROMPTS)):
        last = assert_cumulative(runs[f"s{i}"])
        # every step drafts K (fewer only near max_tokens), and a verification yields at most K + 1
        assert last.verify_steps >= 1 and last.proposed_tokens >= last.verify_steps
        assert last.proposed_tokens <= K * last.verify_steps
        assert runs[f"s{i}"].usage.completion_tokens == MAX_TOKENS
    assert sum(runs[f"s{i}"].usage.speculative_accepted_tokens for i in range(len(PROMPTS))) > 0


def test_speculation_off_for_one_request(draft_runs):
    off = draft_runs[0]["off"]
    assert off.spec and all(s is None for s in off.spec), "a request with speculation off got counters"
    assert off.usage.speculative_proposed_tokens == 0 and off.usage.speculative_accepted_tokens == 0
    assert off.usage.completion_tokens == MAX_TOKENS


def test_max_speculative_tokens_caps_k(draft_runs):
    last = assert_cumulative(draft_runs[0]["k1"])
    assert last.verify_steps >= 1
    assert last.proposed_tokens <= last.verify_steps  # at most one draft token per verification


def test_speculation_methods_choose_the_proposers(draft_runs):
    """methods naming the server's draft model speculate; naming only methods it does not run,
    the request decodes plainly; an unknown name is INVALID_ARGUMENT naming the field."""
    last = assert_cumulative(draft_runs[0]["only-draft"])
    assert last.verify_steps >= 1 and last.proposed_tokens >= 1
    plain = draft_runs[0]["only-ngram"]
    assert plain.spec and all(s is None for s in plain.spec), "a request naming no served method got counters"
    assert plain.usage.speculative_proposed_tokens == 0
    bad = draft_runs[0]["bad-method"].result
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT, bad.final
    assert "methods" in bad.final.error.message and "'tree'" in bad.final.error.message
    assert not bad.token_ids


def test_invalid_cap_is_invalid_argument(draft_runs):
    bad = draft_runs[0]["bad"].result
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT, bad.final
    assert "max_speculative_tokens" in bad.final.error.message
    assert not bad.token_ids


def test_gateway_metrics_count_speculation(draft_runs):
    runs, before, after = draft_runs

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    done = [r for r in runs.values() if r.result.kind == "finished"]
    proposed = sum(r.usage.speculative_proposed_tokens for r in done)
    accepted = sum(r.usage.speculative_accepted_tokens for r in done)
    assert proposed > 0
    assert grew("draftwise_spec_decode_proposed_tokens_total") == proposed
    assert grew("draftwise_spec_decode_accepted_tokens_total") == accepted
    # one acceptance-rate sample per request that speculated (not the one with speculation off)
    # (and not the one naming only methods the server does not run)
    assert grew("draftwise_spec_decode_acceptance_rate_count") == len(PROMPTS) + 2
    assert grew('draftwise_requests_total{status="invalid_argument"}') == 2


# --- n-gram prompt lookup -----------------------------------------------------------------


def test_ngram_server(tmp_path, reference_llm):
    """Another method, the adaptive policy (the default) and the n-gram flags, through
    ``draftwise serve``: same greedy output, counters present, drafts accepted."""
    prompts = PROMPTS[:2]  # the model repeats itself after these: lookup finds what it will say
    s = Serve(tmp_path, "--speculative-method=ngram", "--num-speculative-tokens=3", "--prompt-lookup-max=3")
    try:
        runs = stream(s.address, [spec_start(f"n{i}", p) for i, p in enumerate(prompts)])
        metrics = s.scrape()

        async def models():
            async with grpc.aio.insecure_channel(s.address) as ch:
                return await gsgrpc.GenerateServiceStub(ch).ListModels(gspb.ListModelsRequest(), timeout=30)

        (info,) = asyncio.run(models()).models
    finally:
        s.close()
    ref = reference_tokens(reference_llm, prompts)
    for i, want in enumerate(ref):
        run = runs[f"n{i}"]
        assert run.result.token_ids == want, f"n{i}: n-gram speculation changed the greedy output"
        assert_cumulative(run)
    assert all(r.usage.speculative_proposed_tokens > 0 for r in runs.values())
    assert sum(r.usage.speculative_accepted_tokens for r in runs.values()) > 0
    assert metrics["draftwise_spec_decode_proposed_tokens_total"] == sum(
        r.usage.speculative_proposed_tokens for r in runs.values()
    )
    assert info.has_draft and info.speculative_method == gspb.SPECULATIVE_METHOD_NGRAM
    assert info.draft_model == "" and info.num_speculative_tokens == 3


# --- flags the engine refuses -------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-speculative-tokens=3"], "--num-speculative-tokens set without speculation"),
        (
            ["--speculative-method=ngram", "--speculative-model=default"],
            "--speculative-method ngram needs no draft checkpoint: leave --speculative-model unset",
        ),
        (
            ["--speculative-method=lookahead"],
            "--speculative-method must be one of draft, ngram, eagle, medusa, suffix, got 'lookahead'",
        ),
        (["--speculative-model=default", "--prompt-lookup-max=3"], "--prompt-lookup-min/max apply to"),
        (["--speculative-model=/no/such/draft"], "--speculative-model /no/such/draft: no such file or folder"),
        (["--model=/no/such/model"], "--model /no/such/model: no such file or folder"),
        (["--dtype=fp8"], "--dtype must be one of float32, bfloat16, float16, auto, got 'fp8'"),
    ],
)
def test_serve_refuses_bad_engine_flags_before_starting_a_worker(tmp_path, flags, message):
    """Checked in the launcher, before any process starts; the message names the flags."""
    res = subprocess.run(
        [sys.executable, "-m", "draftwise.cli", "serve", "--port=0", *ENGINE_ARGS, *flags],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"error: {message}"), res.stderr
    assert "worker 0" not in res.stderr and "Traceback" not in res.stderr, res.stderr
