"""The Python client resumes a request whose connection dropped mid-stream: a TCP proxy on
127.0.0.1 between the client and the real gateway resets the connection after a few deltas,
and the caller still gets exactly the tokens of an undisturbed run (no gap, no duplicate),
on ``generate`` (GenerateStream, blocking and asyncio) and on a session (the Generate
stream, several requests at once). With resuming off, or once the gateway cannot be
reached again, the error is raised after the configured attempts."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.integration.procs import CLIENT_DIR, Proc, start_gateway
from tests.integration.tcp_proxy import TcpProxy

sys.path.insert(0, str(CLIENT_DIR))
from draftwise_client import AsyncClient, Client, Delta, GenerationError, ResumePolicy, SamplingParams  # noqa: E402
from draftwise_client._proto import generate_service_pb2 as gspb  # noqa: E402
from draftwise_client._proto import generation_pb2 as pb  # noqa: E402
from draftwise_client._resume import Progress, is_transport_error, resume_outcome  # noqa: E402

PROMPT = "def fibonacci(n):"
TOKENS = 450
"""Several seconds of tokens: a request is surely still running (its tokens not all sent to the
client yet) when the proxy resets the connection, however fast the machine."""
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
FAST = ResumePolicy(initial_backoff_s=0.01, max_backoff_s=0.2)
DROP_AFTER = 3
"""Deltas with tokens the caller reads before the proxy resets the connection."""


@pytest.fixture(scope="module")
def gateway(workers, proc_dir) -> Iterator[Proc]:
    """A gateway with resumption on (the default; the shared test gateway runs without it)."""
    g = start_gateway(workers, proc_dir, "gateway-resume", "--max-in-flight=256")
    yield g
    g.stop()


@pytest.fixture
def proxy(gateway) -> Iterator[TcpProxy]:
    p = TcpProxy(gateway.port)
    yield p
    p.close()


def _undisturbed(address: str, prompt: str, params: SamplingParams) -> tuple[list[int], str]:
    with Client(address) as client:
        deltas = list(client.generate(prompt, params, timeout=60))
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


def _undisturbed_meanwhile(
    address: str, cases: list[tuple[str, SamplingParams]]
) -> Callable[[], list[tuple[list[int], str]]]:
    """Start the undisturbed runs of ``cases`` at once, in threads, straight to the gateway, while
    the test runs its own (a request's output does not depend on what else runs); call the
    result to wait for their outputs."""
    pool = ThreadPoolExecutor(len(cases))
    futures = [pool.submit(_undisturbed, address, prompt, params) for prompt, params in cases]
    pool.shutdown(wait=False)
    return lambda: [f.result(timeout=120) for f in futures]


def _check_contiguous(deltas: list[Delta]) -> None:
    n = 0
    for d in deltas[:-1]:
        assert d.first_token_index == n, f"gap or duplicate at {n}: {d}"
        n += len(d.token_ids)
    assert deltas[-1].finished and deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == n


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_blocking_generate_resumes_after_a_dropped_connection(gateway, proxy, params, caplog):
    refs = _undisturbed_meanwhile(gateway.address, [(PROMPT, params)])
    caplog.set_level(logging.INFO, logger="draftwise_client")
    deltas: list[Delta] = []
    with Client(proxy.address, resume=FAST) as client:
        for d in client.generate(PROMPT, params, timeout=60):
            deltas.append(d)
            if sum(1 for x in deltas if x.token_ids) == DROP_AFTER and not proxy.drops:
                assert proxy.drop() == 1
    ((ref_ids, ref_text),) = refs()
    _check_contiguous(deltas)
    assert deltas[0].resume_handle, "the first delta carries no resume handle"
    assert [t for d in deltas for t in d.token_ids] == ref_ids
    assert "".join(d.text for d in deltas) == ref_text
    assert deltas[-1].finish_reason == "length"
    assert any("resuming" in r.getMessage() for r in caplog.records), "the client never resumed"


def test_async_generate_resumes_after_a_dropped_connection(gateway, proxy):
    refs = _undisturbed_meanwhile(gateway.address, [(PROMPT, GREEDY)])

    async def main() -> list[Delta]:
        out: list[Delta] = []
        async with AsyncClient(proxy.address, resume=FAST) as client:
            async for d in client.generate(PROMPT, GREEDY, timeout=60):
                out.append(d)
                if sum(1 for x in out if x.token_ids) == DROP_AFTER and not proxy.drops:
                    assert proxy.drop() == 1
        return out

    deltas = asyncio.run(main())
    ((ref_ids, ref_text),) = refs()
    _check_contiguous(deltas)
    assert [t for d in deltas for t in d.token_ids] == ref_ids
    assert "".join(d.text for d in deltas) == ref_text


async def _rest(stream: AsyncIterator[Delta]) -> list[Delta]:
    return [d async for d in stream]


def test_session_resumes_every_request_of_a_dropped_stream(gateway, proxy):
    prompts = [PROMPT, "class Stack:", "import os\n\n\ndef list_files(path):"]
    cases = [(p, params) for p in prompts for params in (GREEDY, SEEDED)]
    refs = _undisturbed_meanwhile(gateway.address, cases)

    async def main() -> tuple[list[list[Delta]], list[int], int]:
        async with AsyncClient(proxy.address, resume=FAST) as client, client.session(timeout=90) as s:
            streams = [await s.generate(p, params) for p, params in cases]
            firsts = [await anext(st) for st in streams]  # every request has its handle
            assert proxy.drop() == 1
            rests = await asyncio.gather(*(_rest(st) for st in streams))
            return [[f, *r] for f, r in zip(firsts, rests, strict=True)], [st.resumes for st in streams], s.reconnects

    outs, resumes, reconnects = asyncio.run(main())
    for deltas, (ref_ids, ref_text) in zip(outs, refs(), strict=True):
        _check_contiguous(deltas)
        assert [t for d in deltas for t in d.token_ids] == ref_ids
        assert "".join(d.text for d in deltas) == ref_text
    assert reconnects == 1 and resumes == [1] * len(cases)


def test_blocking_session_resumes_every_request_of_a_dropped_stream(gateway, proxy):
    """The same on the blocking client's session: its reader thread reopens the stream and
    resumes every request; each is read to its end from its own thread."""
    prompts = [PROMPT, "class Stack:"]
    cases = [(p, params) for p in prompts for params in (GREEDY, SEEDED)]
    refs = _undisturbed_meanwhile(gateway.address, cases)
    with Client(proxy.address, resume=FAST) as client, client.session(timeout=90) as s:
        streams = [s.generate(p, params) for p, params in cases]
        firsts = [next(st) for st in streams]  # every request has its handle
        assert proxy.drop() == 1
        with ThreadPoolExecutor(len(streams)) as pool:
            rests = list(pool.map(list, streams))
        resumes, reconnects = [st.resumes for st in streams], s.reconnects
    for first, rest, (ref_ids, ref_text) in zip(firsts, rests, refs(), strict=True):
        deltas = [first, *rest]
        _check_contiguous(deltas)
        assert [t for d in deltas for t in d.token_ids] == ref_ids
        assert "".join(d.text for d in deltas) == ref_text
    assert reconnects == 1 and resumes == [1] * len(cases)


def test_session_sends_again_a_request_that_had_no_delta_when_the_stream_broke(gateway, proxy):
    """The stream is reset right after the start was written: the request has (almost always)
    no delta yet, so no handle, and the session sends it again on the new stream; if its first
    delta did arrive, it is resumed. Either way: once, and exactly the undisturbed output."""
    refs = _undisturbed_meanwhile(gateway.address, [(PROMPT, SEEDED)])

    async def main() -> tuple[list[Delta], int, int]:
        async with AsyncClient(proxy.address, resume=FAST) as client, client.session(timeout=60) as s:
            st = await s.generate(PROMPT, SEEDED)
            assert proxy.drop() == 1
            return await _rest(st), st.attempts, st.resumes

    deltas, attempts, resumes = asyncio.run(main())
    ((ref_ids, ref_text),) = refs()
    _check_contiguous(deltas)
    assert [t for d in deltas for t in d.token_ids] == ref_ids and "".join(d.text for d in deltas) == ref_text
    assert attempts + resumes == 2, (attempts, resumes)


def test_resume_off_raises_the_transport_error(gateway, proxy):
    with Client(proxy.address, resume=None) as client, pytest.raises(GenerationError) as e:
        for d in client.generate(PROMPT, GREEDY, timeout=60):
            if d.token_ids and not proxy.drops:
                proxy.drop()
    assert is_transport_error(e.value) and e.value.resumes == 0


def test_resume_gives_up_after_its_attempts(gateway, proxy):
    """The gateway cannot be reached again (the proxy is gone): the error is raised after
    exactly max_attempts resumes."""
    policy = ResumePolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02)
    with Client(proxy.address, resume=policy) as client, pytest.raises(GenerationError) as e:
        for d in client.generate(PROMPT, GREEDY, timeout=60):
            if d.token_ids and proxy.port:
                assert d.resume_handle or proxy.drops == 0
                proxy.close()
                proxy.port = 0
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.resumes == 2


def _delta(first: int, n: int, handle: str = "") -> pb.GenerationEvent:
    ids = list(range(100 + first, 100 + first + n))
    return pb.GenerationEvent(
        request_id="r", delta=pb.TokenDelta(token_ids=ids, first_token_index=first, resume_handle=handle)
    )


def test_progress_drops_replayed_deltas_and_refuses_gaps():
    p = Progress("r")
    assert p.accept(_delta(0, 2, "h")) and p.handle == "h" and p.next_index == 2
    assert p.accept(_delta(2, 3)) and p.next_index == 5
    assert not p.accept(_delta(2, 3))  # replayed after a resume: dropped
    assert p.resume_message("r2") == gspb.ResumeGeneration(resume_handle="h", next_token_index=5, request_id="r2")
    with pytest.raises(GenerationError) as overlap:
        p.accept(_delta(4, 3))  # overlaps what was received
    with pytest.raises(GenerationError) as gap:
        p.accept(_delta(7, 1))
    assert overlap.value.code == gap.value.code == grpc.StatusCode.DATA_LOSS
    refusal = pb.GenerationEvent(request_id="r", error=pb.RequestError(code=8, message="busy"))
    assert p.accept(refusal) and not p.finished  # a refusal may be retried: not the end
    final = pb.GenerationEvent(request_id="r", finished=pb.Finished(finish_reason=pb.FINISH_REASON_LENGTH))
    assert p.accept(final) and p.finished and not p.accept(final)


def test_resume_policy_validation():
    assert ResumePolicy.off().max_attempts == 0
    for bad in ({"max_attempts": -1}, {"initial_backoff_s": 3.0, "max_backoff_s": 1.0}, {"multiplier": 0.5}):
        with pytest.raises(ValueError):
            ResumePolicy(**bad)
    delays = [FAST.delay_s(i) for i in range(1, 8)]
    assert delays[0] >= 0.01 and max(delays) <= 0.2 * 1.2


def test_a_resume_that_finds_nothing_reports_why_the_request_ended():
    cause = GenerationError(grpc.StatusCode.UNAVAILABLE, "worker gone; the request had already moved 2 times", "r")
    gone = GenerationError(grpc.StatusCode.NOT_FOUND, "no request with this resume handle", "r")
    out = resume_outcome(gone, cause)
    assert out.code == grpc.StatusCode.UNAVAILABLE and out.message == cause.message
    assert resume_outcome(gone, None) is gone  # nothing was resumed: as it is
    dropped = GenerationError(grpc.StatusCode.UNAVAILABLE, "Socket closed", "r")
    assert resume_outcome(gone, dropped) is gone  # after a plain drop, NOT_FOUND is the news
    other = GenerationError(grpc.StatusCode.INVALID_ARGUMENT, "next_token_index beyond the output", "r")
    assert resume_outcome(other, cause) is other
