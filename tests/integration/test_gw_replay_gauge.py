"""The gateway's ``draftwise_replay_buffer_bytes`` gauge is read from the replay budget when
scraped (the relay no longer sets it per delta): it shows the bytes a running resumable
request holds, and 0 once that request finished and its buffer was dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from tests.integration.procs import Proc, metrics_port, start_gateway
from tests.integration.rpc import scrape_metrics, start, start_req

GAUGE = "draftwise_replay_buffer_bytes"
N_TOKENS = 450  # surely still running when scraped at its 3rd delta (the context is 512)


@pytest.fixture(scope="module")
def resumable_gateway(workers: list[Proc], proc_dir: Path) -> Iterator[Proc]:
    g = start_gateway(workers, proc_dir, "gw-replay-gauge", "--resume-retention-s=30")
    yield g
    g.stop()


def test_replay_gauge_follows_the_buffers(resumable_gateway: Proc) -> None:
    port = metrics_port(resumable_gateway)
    assert scrape_metrics(port)[GAUGE] == 0

    async def main() -> tuple[float, list[tuple[int, int]], str]:
        async with grpc.aio.insecure_channel(resumable_gateway.address) as ch:
            call = gsgrpc.GenerateServiceStub(ch).Generate()
            await call.write(start_req(start("g", max_tokens=N_TOKENS, ignore_eos=True, temperature=0)))
            await call.done_writing()
            spans: list[tuple[int, int]] = []
            held = -1.0
            last = ""
            async for resp in call:
                ev = resp.event
                last = ev.WhichOneof("kind")
                if last == "delta":
                    spans.append((ev.delta.first_token_index, len(ev.delta.token_ids)))
                    if len(spans) == 3:  # mid-request: the scrape runs off the event loop
                        held = await asyncio.to_thread(lambda: scrape_metrics(port)[GAUGE])
            return held, spans, last

    held, spans, last = asyncio.run(main())
    assert last == "finished"
    assert held > 0, "a running resumable request holds replay bytes"
    # token indices exact: every delta starts where the previous one ended
    assert [first for first, _ in spans] == [sum(n for _, n in spans[:i]) for i in range(len(spans))]
    assert sum(n for _, n in spans) == N_TOKENS
    assert scrape_metrics(port)[GAUGE] == 0, "a finished request's buffer is dropped"
