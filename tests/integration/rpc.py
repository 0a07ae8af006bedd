"""Raw gRPC helpers for the integration tests (generated stubs, no client library)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from draftwise.hop import secret_metadata
from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.v1 import worker_service_pb2_grpc as wgrpc
from tests.integration.procs import INTERNAL_SECRET


def worker_metadata(secret: str = INTERNAL_SECRET) -> tuple[tuple[str, str], ...]:
    """Metadata of a direct call to a worker started by ``tests.integration.procs``:
    ``stub.Generate(req, metadata=worker_metadata())``."""
    return secret_metadata(secret)


def start(
    request_id: str,
    prompt: str | Sequence[int] = "def fibonacci(n):",
    model: str = "",
    **params: object,
) -> pb.StartGeneration:
    p = pb.Prompt(text=prompt) if isinstance(prompt, str) else pb.Prompt(token_ids=pb.TokenIds(ids=list(prompt)))
    return pb.StartGeneration(request_id=request_id, model=model, prompt=p, sampling_params=pb.SamplingParams(**params))


def start_req(s: pb.StartGeneration) -> gspb.GenerateRequest:
    return gspb.GenerateRequest(start=s)


def cancel_req(request_id: str) -> gspb.GenerateRequest:
    return gspb.GenerateRequest(cancel=pb.CancelGeneration(request_id=request_id))


@dataclass
class Result:
    """Everything one request got on a stream."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    final: pb.GenerationEvent | None = None
    delta_times: list[float] = field(default_factory=list)
    delta_sizes: list[int] = field(default_factory=list)  # tokens per delta

    def add(self, event: pb.GenerationEvent) -> None:
        assert self.final is None, f"{self.request_id}: an event after the final one: {event}"
        kind = event.WhichOneof("kind")
        if kind == "delta":
            d = event.delta
            assert d.first_token_index == len(self.token_ids), f"{self.request_id}: gap or duplicate: {event}"
            self.token_ids.extend(d.token_ids)
            self.text += d.text
            self.delta_times.append(time.perf_counter())
            self.delta_sizes.append(len(d.token_ids))
        else:
            self.final = event

    @property
    def kind(self) -> str | None:
        return None if self.final is None else self.final.WhichOneof("kind")

    @property
    def code(self) -> grpc.StatusCode | None:
        if self.kind != "error":
            return None
        return next(c for c in grpc.StatusCode if c.value[0] == self.final.error.code)

    @property
    def finish_reason(self) -> int | None:
        return self.final.finished.finish_reason if self.kind == "finished" else None


async def run_stream(
    stub: gsgrpc.GenerateServiceStub,
    starts: Sequence[pb.StartGeneration],
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float = 120.0,
) -> dict[str, Result]:
    """Send every start on one Generate stream, half-close, read until the call ends OK."""
    call = stub.Generate(metadata=metadata or None, timeout=timeout)
    results: dict[str, Result] = {}
    for s in starts:
        await call.write(start_req(s))
    await call.done_writing()
    async for resp in call:
        ev = resp.event
        results.setdefault(ev.request_id, Result(ev.request_id)).add(ev)
    assert await call.code() == grpc.StatusCode.OK
    return results


async def worker_loads(addresses: Sequence[str], secret: str = INTERNAL_SECRET) -> list[wpb.GetLoadResponse]:
    out = []
    for a in addresses:
        async with grpc.aio.insecure_channel(a) as ch:
            stub = wgrpc.WorkerServiceStub(ch)
            out.append(await stub.GetLoad(wpb.GetLoadRequest(), timeout=5, metadata=worker_metadata(secret)))
    return out


async def wait_workers_idle(addresses: Sequence[str], timeout: float = 30.0) -> float:
    """Seconds until every worker has all KV blocks free and nothing running; AssertionError
    after ``timeout`` (a liveness bound: print the seconds, never assert a tight one)."""
    t0 = time.monotonic()
    while True:
        loads = await worker_loads(addresses)
        if all(
            lo.num_free_kv_blocks == lo.num_total_kv_blocks
            and lo.num_requests_running == 0
            and not lo.num_requests_waiting
            for lo in loads
        ):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"workers not idle after {timeout} s: {loads}")
        await asyncio.sleep(0.01)


def scrape_metrics(port: int) -> dict[str, float]:
    """The gateway's Prometheus metrics on 127.0.0.1:``port``: {'name{labels}': value}."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
