"""Processes and checks shared by the reliability suites: a plain worker and a speculating
worker (the embedded draft model) of the embedded default model, each behind its own
gateway so that a test can aim traffic at one of them, started once per module. The gateways
run with the flags of the module's ``GATEWAY_FLAGS`` (default: ``--resume-retention-s=0``, a
request whose client went away is cancelled at once); with the default retention a request
whose client went away is kept for a resume, paused: it holds no worker compute either, so the
workers' idleness after a suite depends on nothing but cancellation and pausing."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import generation_pb2 as pb
from tests.integration.procs import ENGINE_ARGS, PARENT, Proc, secret_args, start_gateway
from tests.integration.rpc import start, wait_workers_idle

WORKER_KINDS: dict[str, tuple[str, ...]] = {
    "plain": (),
    "spec": ("--speculative-model=default",),
}
"""Worker name -> extra engine flags: one without speculation, one with the embedded draft."""

IDLE_TIMEOUT_S = 30.0
"""How long the workers get to show every KV block free and nothing running after a suite: a
liveness bound (a leaked block or request never frees); the time it took is returned, for the
suites to print."""


@dataclass
class Stack:
    """Real workers, one gateway in front of each, and the worker PIDs seen at start."""

    workers: dict[str, Proc]
    gateways: dict[str, Proc]
    pids: dict[str, int]

    @property
    def worker_addresses(self) -> list[str]:
        return [w.address for w in self.workers.values()]


def start_worker(name: str, tmp: Path, extra: Sequence[str] = ()) -> Proc:
    """One worker process of the embedded default model, started the way
    ``tests.integration.procs.start_workers`` starts them (not waited for)."""
    args = [
        "-m",
        "draftwise.worker.serving.server",
        "--port=0",
        "--log-format=json",
        *PARENT,
        *secret_args(),
        *ENGINE_ARGS,
    ]
    args.extend(extra)
    return Proc(name, args, tmp)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp(f"rel-{request.module.__name__.rsplit('.', 1)[-1]}")
    flags = getattr(request.module, "GATEWAY_FLAGS", ("--resume-retention-s=0",))
    workers = {name: start_worker(f"worker-{name}", tmp, extra) for name, extra in WORKER_KINDS.items()}
    gateways: dict[str, Proc] = {}
    try:
        for w in workers.values():
            w.wait_ready()
        for name, w in workers.items():
            gateways[name] = start_gateway([w], tmp, f"gateway-{name}", *flags)
        yield Stack(workers, gateways, {name: w.popen.pid for name, w in workers.items()})
    finally:
        for g in gateways.values():
            g.stop()
        for w in workers.values():
            w.stop()


RST_STREAM = "INTERNAL_RST_STREAM"
"""What a call with a very short deadline may end with instead of DEADLINE_EXCEEDED: the
server's deadline fired first and reset the HTTP/2 stream, which the client's gRPC core
reports as INTERNAL "Internal error from Core" (deadline status over HTTP/2 is best
effort: grpc/grpc#2685). Allowed only for deadline cases, and counted apart."""


def call_status(e: grpc.aio.AioRpcError) -> str:
    """The name of a failed call's status; RST_STREAM for the transport's deadline race."""
    if e.code() == grpc.StatusCode.INTERNAL and e.details() == "Internal error from Core":
        return RST_STREAM
    return e.code().name


def status_name(code: grpc.StatusCode | int) -> str:
    """``INVALID_ARGUMENT`` for a StatusCode or its number."""
    if isinstance(code, int):
        code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    return code.name


async def normal_request(address: str) -> pb.GenerationEvent:
    """The final event of a small greedy GenerateStream request (raises AioRpcError on failure)."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gsgrpc.GenerateServiceStub(ch)
        final = None
        req = gspb.GenerateStreamRequest(start=start("", "def fibonacci(n):", max_tokens=4, temperature=0))
        async for resp in stub.GenerateStream(req, timeout=30):
            if resp.event.WhichOneof("kind") != "delta":
                final = resp.event
        assert final is not None
        return final


def deaths(stack: Stack, everyone: bool = False) -> dict[str, tuple[int | None, list[str]]]:
    """Workers that exited (or, with ``everyone``, all of them): exit status (None: alive)
    and the last error lines of their log."""
    out = {}
    for name, w in stack.workers.items():
        if everyone or w.popen.poll() is not None:
            errors = [line[:300] for line in w.log().splitlines() if "Error" in line or '"error"' in line]
            out[name] = (w.popen.poll(), errors[:2] + errors[-2:] if len(errors) > 4 else errors)
    return out


def assert_survived(stack: Stack, idle_timeout: float = IDLE_TIMEOUT_S) -> float:
    """The same worker processes are alive (none died or was replaced), hold no KV block and
    run nothing within ``idle_timeout`` seconds, and each serves a normal request through its
    gateway. Returns the seconds the workers took to become idle."""
    assert not deaths(stack), f"workers died: {deaths(stack)}"
    assert {name: w.popen.pid for name, w in stack.workers.items()} == stack.pids

    async def main() -> tuple[float, dict[str, pb.GenerationEvent]]:
        idle = await wait_workers_idle(stack.worker_addresses, timeout=idle_timeout)
        finals = {name: await normal_request(g.address) for name, g in stack.gateways.items()}
        return idle, finals

    try:
        idle, finals = asyncio.run(main())
    except grpc.aio.AioRpcError as e:
        for w in stack.workers.values():  # one on its way out: let it go, then say why
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.popen.wait(3.0)
        raise AssertionError(f"{e.code().name}: {e.details()}; workers: {deaths(stack, everyone=True)}") from None
    for name, final in finals.items():
        assert final.WhichOneof("kind") == "finished", (name, final)
        assert final.finished.finish_reason == pb.FINISH_REASON_LENGTH, (name, final)
        assert final.finished.usage.completion_tokens == 4, (name, final)
    return idle


def format_table(counts: Counter[tuple[str, str]], title: str) -> str:
    """A markdown table of case kind x outcome counts, with row and column totals."""
    kinds = sorted({k for k, _ in counts})
    outcomes = sorted({o for _, o in counts})
    lines = [f"| {title} | " + " | ".join(outcomes) + " | total |", "|---" * (len(outcomes) + 2) + "|"]
    for k in kinds:
        row = [counts.get((k, o), 0) for o in outcomes]
        lines.append(f"| {k} | " + " | ".join(str(n) if n else "" for n in row) + f" | {sum(row)} |")
    col = [sum(counts.get((k, o), 0) for k in kinds) for o in outcomes]
    lines.append("| **total** | " + " | ".join(str(n) for n in col) + f" | {sum(col)} |")
    return "\n".join(lines)


class Stopwatch:
    """Seconds since construction."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.t0


# -- protobuf wire encoding, for messages the generated classes refuse to build (negative
# values in unsigned fields, invalid UTF-8, truncated or random bytes) --------------------


def varint(n: int) -> bytes:
    """Base-128 varint of ``n`` (a negative number as its 64-bit two's complement, 10 bytes)."""
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_varint(number: int, value: int) -> bytes:
    """A varint field (wire type 0)."""
    return varint(number << 3) + varint(value)


def field_bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): a string, bytes or an embedded message."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload
