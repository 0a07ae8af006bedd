"""Resume through any gateway replica: two real gateways over the same workers behind one
address (a TCP proxy, as a Kubernetes Service without session affinity), a client streaming
through it, its connection reset after a few deltas while the proxy now sends new connections
to the other gateway. That gateway does not know the resume handle (NOT_FOUND, reason
``unknown-handle``): the client starts the request again there as a continuation of the tokens
it holds, and the caller gets exactly the undisturbed tokens and text, greedy and seeded, on the
blocking and asyncio ``generate`` and on a session."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from tests.integration.procs import CLIENT_DIR, Proc, start_gateway
from tests.integration.tcp_proxy import TcpProxy

sys.path.insert(0, str(CLIENT_DIR))
from draftwise_client import AsyncClient, Client, Delta, ResumePolicy, SamplingParams  # noqa: E402
from draftwise_client._proto import generate_service_pb2 as gspb  # noqa: E402
from draftwise_client._proto import generate_service_pb2_grpc as gsgrpc  # noqa: E402

PROMPT = "def fibonacci(n):"
TOKENS = 300
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True)
FAST = ResumePolicy(initial_backoff_s=0.01, max_backoff_s=0.2)
DROP_AFTER = 3
"""Deltas with tokens the caller reads before the connection is reset."""


@pytest.fixture(scope="module")
def gateways(workers, proc_dir) -> Iterator[tuple[Proc, Proc]]:
    """Two replicas with resumption on (the default), sharing the workers and nothing else."""
    a = start_gateway(workers, proc_dir, "gateway-replica-a", "--max-in-flight=256")
    b = start_gateway(workers, proc_dir, "gateway-replica-b", "--max-in-flight=256")
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture
def proxy(gateways) -> Iterator[TcpProxy]:
    p = TcpProxy(gateways[0].port)  # new connections go to replica A until the test switches
    yield p
    p.close()


def _switch_and_drop(proxy: TcpProxy, to: Proc) -> None:
    """New connections go to ``to`` from now on; the open ones are reset."""
    proxy.target_port = to.port
    assert proxy.drop() == 1


def _undisturbed(address: str, params: SamplingParams) -> tuple[list[int], str]:
    with Client(address) as client:
        deltas = list(client.generate(PROMPT, params, timeout=120))
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


def _check(deltas: list[Delta], ref: tuple[list[int], str]) -> None:
    n = 0
    for d in deltas[:-1]:
        assert d.first_token_index == n, f"gap or duplicate at {n}: {d}"
        n += len(d.token_ids)
    last = deltas[-1]
    assert last.finished and last.finish_reason == "length"
    assert last.usage is not None and last.usage.completion_tokens == n == TOKENS
    assert [t for d in deltas for t in d.token_ids] == ref[0]
    assert "".join(d.text for d in deltas) == ref[1]


def _continued(caplog: pytest.LogCaptureFixture, n: int = 1) -> None:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("continuing")]
    assert len(lines) == n, f"expected {n} continuation(s), got {lines}"


@pytest.fixture(scope="module")
def refs(gateways) -> dict[str, tuple[list[int], str]]:
    return {"greedy": _undisturbed(gateways[1].address, GREEDY), "seeded": _undisturbed(gateways[1].address, SEEDED)}


PARAMS = pytest.mark.parametrize("name,params", [("greedy", GREEDY), ("seeded", SEEDED)], ids=["greedy", "seeded"])


def test_the_other_replica_says_the_handle_is_unknown_there(gateways, proxy):
    """What the client decides on: NOT_FOUND with the machine-readable reason."""
    with Client(proxy.address) as client:
        for d in client.generate(PROMPT, GREEDY, timeout=60):
            handle = d.resume_handle
            break
    with grpc.insecure_channel(gateways[1].address) as channel:
        call = gsgrpc.GenerateServiceStub(channel).GenerateStream(
            gspb.GenerateStreamRequest(resume=gspb.ResumeGeneration(resume_handle=handle, next_token_index=1))
        )
        with pytest.raises(grpc.RpcError) as e:
            list(call)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert ("draftwise-resume-reason", "unknown-handle") in tuple(e.value.trailing_metadata())  # type: ignore[attr-defined]


@PARAMS
def test_blocking_generate_goes_on_at_the_other_replica(gateways, proxy, refs, name, params, caplog):
    caplog.set_level(logging.INFO, logger="draftwise_client")
    deltas: list[Delta] = []
    with Client(proxy.address, resume=FAST) as client:
        for d in client.generate(PROMPT, params, timeout=120):
            deltas.append(d)
            if sum(1 for x in deltas if x.token_ids) == DROP_AFTER and not proxy.drops:
                _switch_and_drop(proxy, gateways[1])
    _check(deltas, refs[name])
    _continued(caplog)


@PARAMS
def test_async_generate_goes_on_at_the_other_replica(gateways, proxy, refs, name, params, caplog):
    caplog.set_level(logging.INFO, logger="draftwise_client")

    async def main() -> list[Delta]:
        out: list[Delta] = []
        async with AsyncClient(proxy.address, resume=FAST) as client:
            async for d in client.generate(PROMPT, params, timeout=120):
                out.append(d)
                if sum(1 for x in out if x.token_ids) == DROP_AFTER and not proxy.drops:
                    _switch_and_drop(proxy, gateways[1])
        return out

    _check(asyncio.run(main()), refs[name])
    _continued(caplog)


async def _rest(stream: AsyncIterator[Delta]) -> list[Delta]:
    return [d async for d in stream]


def test_session_goes_on_at_the_other_replica(gateways, proxy, refs, caplog):
    caplog.set_level(logging.INFO, logger="draftwise_client")
    cases = [("greedy", GREEDY), ("seeded", SEEDED)]

    async def main() -> list[list[Delta]]:
        async with AsyncClient(proxy.address, resume=FAST) as client, client.session(timeout=120) as s:
            streams = [await s.generate(PROMPT, params) for _, params in cases]
            firsts = [await anext(st) for st in streams]  # every request has its handle
            _switch_and_drop(proxy, gateways[1])
            rests = await asyncio.gather(*(_rest(st) for st in streams))
            assert s.reconnects == 1
            return [[f, *r] for f, r in zip(firsts, rests, strict=True)]

    for (name, _), deltas in zip(cases, asyncio.run(main()), strict=True):
        _check(deltas, refs[name])
    _continued(caplog, len(cases))


def test_blocking_session_goes_on_at_the_other_replica(gateways, proxy, refs, caplog):
    caplog.set_level(logging.INFO, logger="draftwise_client")
    with Client(proxy.address, resume=FAST) as client, client.session(timeout=120) as s:
        stream = s.generate(PROMPT, SEEDED)
        first = next(stream)
        _switch_and_drop(proxy, gateways[1])
        deltas = [first, *stream]
        assert s.reconnects == 1
    _check(deltas, refs["seeded"])
    _continued(caplog)
