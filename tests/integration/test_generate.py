"""Generation through the gateway equals the offline engine's greedy output, across many
concurrent requests on several multiplexed streams; GenerateStream, ListModels, half-close."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from draftwise.worker import SamplingParams
from tests.integration.conftest import reference_outputs
from tests.integration.procs import MAX_MODEL_LEN, MODEL_NAME
from tests.integration.prompts import max_tokens, prompts
from tests.integration.rpc import run_stream, start, wait_workers_idle

N_STREAMS = 5
PER_STREAM = 10


@pytest.fixture(scope="module")
def reference(reference_llm):
    texts = prompts(N_STREAMS * PER_STREAM)
    params = [SamplingParams(temperature=0, max_tokens=max_tokens(i)) for i in range(len(texts))]
    outs = reference_outputs(reference_llm, texts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_50_concurrent_requests_on_5_streams_match_offline_greedy(gateway, workers, reference):
    texts = prompts(N_STREAMS * PER_STREAM)

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            per_stream = []
            for s in range(N_STREAMS):
                idx = range(s * PER_STREAM, (s + 1) * PER_STREAM)
                # the same request ids on every stream: ids are scoped to their stream
                per_stream.append(
                    [start(f"r{i % PER_STREAM}", texts[i], temperature=0, max_tokens=max_tokens(i)) for i in idx]
                )
            return await asyncio.gather(*(run_stream(stub, starts) for starts in per_stream))

    results = asyncio.run(main())
    finish = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
    for s, res in enumerate(results):
        assert len(res) == PER_STREAM
        for j in range(PER_STREAM):
            i = s * PER_STREAM + j
            r = res[f"r{j}"]
            ref_ids, ref_text, ref_reason = reference[i]
            assert r.kind == "finished", r.final
            assert r.token_ids == ref_ids, f"request {i}: {texts[i]!r}"
            assert r.text == ref_text
            assert r.finish_reason == finish[ref_reason]
            assert r.final.finished.usage.completion_tokens == len(ref_ids)
            assert r.final.finished.usage.prompt_tokens > 0
    # both workers took a share of the load, and every block came back
    asyncio.run(wait_workers_idle([w.address for w in workers]))
    served = [e for g in [gateway] for e in g.log_events() if e.get("event") == "request finished"]
    assert {e["worker"] for e in served} == {w.address for w in workers}


def test_generate_stream_matches_offline_greedy(gateway, reference):
    text = prompts(1)[0]

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            req = gspb.GenerateStreamRequest(start=start("", text, temperature=0, max_tokens=max_tokens(0)))
            call = stub.GenerateStream(req, timeout=60)
            events = [r.event async for r in call]
            return events, await call.code()

    events, code = asyncio.run(main())
    assert code == grpc.StatusCode.OK
    assert events[-1].WhichOneof("kind") == "finished"
    rid = events[0].request_id
    assert rid and all(e.request_id == rid for e in events)  # the server picked one id
    ids = [t for e in events[:-1] for t in e.delta.token_ids]
    assert ids == reference[0][0]
    assert "".join(e.delta.text for e in events[:-1]) == reference[0][1]


def test_list_models(gateway):
    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            return await gsgrpc.GenerateServiceStub(ch).ListModels(gspb.ListModelsRequest(), timeout=10)

    resp = asyncio.run(main())
    assert [m.name for m in resp.models] == [MODEL_NAME]
    assert resp.default_model == MODEL_NAME
    assert resp.models[0].max_model_len == MAX_MODEL_LEN
    assert not resp.models[0].has_draft  # this server runs without speculation
    assert resp.models[0].speculative_method == 0 and resp.models[0].num_speculative_tokens == 0


def test_half_close_finishes_in_flight_requests_then_ok(gateway):
    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            empty = await run_stream(stub, [])  # half-close at once: the call just ends OK
            res = await run_stream(stub, [start("a", max_tokens=30, ignore_eos=True, temperature=0)])
            return empty, res

    empty, res = asyncio.run(main())
    assert empty == {}
    assert res["a"].finish_reason == pb.FINISH_REASON_LENGTH and len(res["a"].token_ids) == 30
