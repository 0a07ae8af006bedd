"""A worker that dies between a request's last token and its final event (found by the chaos
test in CI): the gateway holds the whole output and fails over with it as the continuation; the
next worker refuses it (INVALID_ARGUMENT, nothing left to generate) and says in trailing metadata
how that output ended, and the gateway then finishes the request itself, LENGTH or STOP, with the
usage so far, instead of ending a complete request with an error.

Real worker process, real gRPC on 127.0.0.1, the gateway's own Relay and Router in this process;
the state after the failover (all tokens held, continuation sent) is set up with ``as_continuation``,
the function the failover path calls."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from draftwise.gateway.admit import Admitted
from draftwise.gateway.config import GatewayConfig
from draftwise.gateway.failover import as_continuation, finished_by
from draftwise.gateway.relay import Relay
from draftwise.gateway.server import Gateway
from draftwise.gateway.streams import Outbox
from draftwise.v1 import generation_pb2 as pb
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.v1 import worker_service_pb2_grpc as wgrpc
from draftwise.wire import FINISHED_REASON_KEY, FINISHED_STOP_STR_KEY, FINISHED_STOP_TOKEN_KEY
from tests.integration.procs import INTERNAL_SECRET, start_workers
from tests.integration.rpc import start, worker_metadata

N = 12
PROMPT = list(range(100, 120))  # token ids: the relay knows the prompt's size up front (text: from the first delta)
GREEDY = {"temperature": 0, "max_tokens": N, "ignore_eos": True}


@pytest.fixture(scope="module")
def worker(proc_dir):
    (w,) = start_workers(1, proc_dir, prefix="fin")
    yield w
    w.kill()


async def _worker_output(address: str, s: pb.StartGeneration) -> list[int]:
    async with grpc.aio.insecure_channel(address) as ch:
        ids: list[int] = []
        call = wgrpc.WorkerServiceStub(ch).Generate(
            wpb.WorkerServiceGenerateRequest(start=s), metadata=worker_metadata(), timeout=120
        )
        async for resp in call:
            if resp.event.WhichOneof("kind") == "delta":
                ids.extend(resp.event.delta.token_ids)
        return ids


async def _relay_events(address: str, s: pb.StartGeneration, held: list[int], resubmitted: bool) -> list:
    """Run ``s`` through the gateway's Relay holding ``held`` as the tokens its client has:
    ``resubmitted`` as after a failover (the gateway's continuation), else as a client's own."""
    config = GatewayConfig(workers=(address,), internal_secret=INTERNAL_SECRET, load_poll_interval_s=0.05)
    gw = Gateway(config)
    await gw.router.start()
    try:
        for _ in range(200):
            if gw.router.pick("draftwise-target", frozenset()) is not None:
                break
            await asyncio.sleep(0.05)
        if not resubmitted:
            s.continuation.output_token_ids.extend(held)
        outbox = Outbox(1000)
        relay = Relay(gw.core, "r", s, Admitted("draftwise-target"), outbox, 60.0)
        if resubmitted:
            relay.tokens.extend(held)
            as_continuation(relay)
        assert gw.core.admission.try_acquire()  # (a relay starts holding its admission slot)
        await asyncio.wait_for(relay.start(), 60)
        events = []
        while len(outbox):
            events.append((await outbox.get()).event)
        return events
    finally:
        await gw.router.close()


def test_a_whole_output_held_after_a_failover_finishes_length(worker):
    ids = asyncio.run(_worker_output(worker.address, start("ref", PROMPT, **GREEDY)))
    assert len(ids) == N
    events = asyncio.run(_relay_events(worker.address, start("", PROMPT, **GREEDY), ids, resubmitted=True))
    assert [e.WhichOneof("kind") for e in events] == ["finished"], events
    f = events[0].finished
    assert f.finish_reason == pb.FINISH_REASON_LENGTH and f.usage.completion_tokens == N, f
    assert f.usage.prompt_tokens == len(PROMPT) and f.timings.total_ms > 0


def test_a_whole_output_ending_on_a_stop_token_finishes_stop(worker):
    ids = asyncio.run(_worker_output(worker.address, start("ref", PROMPT, **GREEDY)))
    k = next(i for i, t in enumerate(ids) if t not in ids[:i])  # (the first time that token appears)
    params = {"temperature": 0, "max_tokens": 4 * N, "ignore_eos": True, "stop_token_ids": [ids[k]]}
    # the worker itself stops on it (the stop token is part of the output, as it is for EOS)
    assert asyncio.run(_worker_output(worker.address, start("ref2", PROMPT, **params))) == ids[: k + 1]
    events = asyncio.run(_relay_events(worker.address, start("", PROMPT, **params), ids[: k + 1], resubmitted=True))
    assert [e.WhichOneof("kind") for e in events] == ["finished"], events
    f = events[0].finished
    assert f.finish_reason == pb.FINISH_REASON_STOP and f.stop_token_id == ids[k], f
    assert f.usage.completion_tokens == k + 1


def test_a_clients_own_finished_continuation_stays_invalid_argument(worker):
    """The documented contract for clients (docs/serving.md) is unchanged: only the gateway's own
    continuation, built from what its workers sent, is finished this way."""
    ids = asyncio.run(_worker_output(worker.address, start("ref", PROMPT, **GREEDY)))
    events = asyncio.run(_relay_events(worker.address, start("", PROMPT, **GREEDY), ids, resubmitted=False))
    assert [e.WhichOneof("kind") for e in events] == ["error"], events
    assert events[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "already finished" in events[0].error.message


def test_the_worker_says_how_the_output_ended_in_trailing_metadata(worker):
    ids = asyncio.run(_worker_output(worker.address, start("ref", PROMPT, **GREEDY)))

    async def refusal(s: pb.StartGeneration) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            call = wgrpc.WorkerServiceStub(ch).Generate(
                wpb.WorkerServiceGenerateRequest(start=s), metadata=worker_metadata(), timeout=60
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            return e.value

    s = start("whole", PROMPT, **GREEDY)
    s.continuation.output_token_ids.extend(ids)
    e = asyncio.run(refusal(s))
    md = dict(e.trailing_metadata() or ())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and md.get(FINISHED_REASON_KEY) == "length", md
    s = start("longer", PROMPT, **GREEDY)
    s.continuation.output_token_ids.extend([*ids, ids[0]])  # no output of this request: refused, no reason
    e = asyncio.run(refusal(s))
    md = dict(e.trailing_metadata() or ())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and FINISHED_REASON_KEY not in md, md
    assert finished_by(e.trailing_metadata(), constrained=False) is None


def test_finished_by_reads_every_ending():
    assert finished_by((), False) is None
    assert finished_by(((FINISHED_REASON_KEY, "other"),), False) is None
    f = finished_by(((FINISHED_REASON_KEY, "length"),), True)
    assert f is not None and f.finish_reason == pb.FINISH_REASON_LENGTH and f.constraint_unfinished
    f = finished_by(((FINISHED_REASON_KEY, "stop"),), True)  # EOS: a constrained output is complete
    assert f is not None and f.finish_reason == pb.FINISH_REASON_STOP and not f.constraint_unfinished
    assert f.WhichOneof("stop_reason") is None
    f = finished_by(((FINISHED_REASON_KEY, "stop"), (FINISHED_STOP_TOKEN_KEY, "7")), True)
    assert f is not None and f.stop_token_id == 7 and f.constraint_unfinished
    f = finished_by(((FINISHED_REASON_KEY, "stop"), (FINISHED_STOP_STR_KEY, "é\n".encode())), False)
    assert f is not None and f.stop_str == "é\n" and not f.constraint_unfinished
