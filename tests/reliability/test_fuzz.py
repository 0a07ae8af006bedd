"""Fuzz: thousands of malformed and edge-case requests over ``Generate`` (the multiplexed
stream) and ``GenerateStream``, through real gateways, to a plain and a speculating worker.

Every response must be a precise status from the list allowed for its kind of case (never
UNKNOWN or INTERNAL, never a hang, never an error message that echoes unbounded input), and
afterwards the same worker processes must be alive, hold no KV block, and serve. The cases
(``fuzz_cases.py``) are deterministic: sampling parameters come from hypothesis
(derandomized), the rest from a seeded generator. Run with ``-s`` to see the table of case
kinds x statuses; ``DRAFTWISE_FUZZ_KINDS=a,b`` runs only those kinds.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter

import grpc

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generation_pb2 as pb
from tests.reliability.conftest import Stack, Stopwatch, assert_survived, call_status, format_table, status_name
from tests.reliability.fuzz_cases import ABORT, MISSING, NO_EVENT, OK, Call, build_calls, select_kinds

SEED = 1010
MIN_CASES = 2000
MAX_ERROR_MESSAGE = 4096
"""Longest acceptable error message: a longer one echoes unbounded client input."""
CONCURRENCY = 32
"""Calls in flight at once."""
GENERATE = "/draftwise.v1.GenerateService/Generate"
GENERATE_STREAM = "/draftwise.v1.GenerateService/GenerateStream"
LONG = "+LONG_MESSAGE"
"""Appended to a status whose message is longer than MAX_ERROR_MESSAGE."""


# -- running them -------------------------------------------------------------------------


def outcome_of(event: pb.GenerationEvent) -> str:
    kind = event.WhichOneof("kind")
    if kind == "finished":
        return ABORT if event.finished.finish_reason == pb.FINISH_REASON_ABORT else OK
    name = status_name(event.error.code)
    return name + LONG if len(event.error.message) > MAX_ERROR_MESSAGE else name


def error_outcome(e: grpc.aio.AioRpcError) -> str:
    details = e.details() or ""
    return call_status(e) + (LONG if len(details) > MAX_ERROR_MESSAGE else "")


Result = tuple[str, str, str]
"""(case kind, outcome, a note for failures)."""


async def run_stream_call(ch: grpc.aio.Channel, call: Call) -> list[Result]:
    (msg,) = call.messages
    method = ch.unary_stream(GENERATE_STREAM, response_deserializer=gspb.GenerateStreamResponse.FromString)
    final = None
    try:
        async for resp in method(msg.wire, timeout=call.timeout):
            if resp.event.WhichOneof("kind") != "delta":
                final = resp.event
    except grpc.aio.AioRpcError as e:
        return [(msg.kind, error_outcome(e), (e.details() or "")[:200])]
    return [(msg.kind, outcome_of(final) if final else "OK_WITHOUT_FINAL", "")]


async def run_bidi_call(ch: grpc.aio.Channel, call: Call) -> list[Result]:
    method = ch.stream_stream(GENERATE, response_deserializer=gspb.GenerateResponse.FromString)
    rpc = method(timeout=call.timeout)
    finals: dict[str, list[pb.GenerationEvent]] = {}
    anon: list[pb.GenerationEvent] = []
    seen: set[str] = set()

    async def read() -> None:
        async for resp in rpc:
            ev = resp.event
            seen.add(ev.request_id)
            if ev.WhichOneof("kind") == "delta":
                continue
            if ev.request_id:
                finals.setdefault(ev.request_id, []).append(ev)
            else:
                anon.append(ev)

    reader = asyncio.create_task(read())
    try:
        for m in call.messages:
            await rpc.write(m.wire)
        await rpc.done_writing()
    except Exception:  # noqa: S110 (AioRpcError, UsageError, cygrpc's ExecuteBatchError...)
        pass  # the call already ended: its status says why
    note = ""
    try:
        await reader
        status = OK
    except grpc.aio.AioRpcError as e:
        status, note = error_outcome(e), (e.details() or "")[:200]
    out: list[Result] = [(call.kind, status, note)]
    anon_iter = iter(anon)
    for m in call.messages:
        if m.expect == "final":
            evs = finals.get(m.rid, [])
            ended = MISSING if status == OK else f"CALL_{status}"  # no final event: the call ended first
            out.append((m.kind, "+".join(sorted(outcome_of(e) for e in evs)) or ended, ""))
        elif m.expect == "none":
            out.append((m.kind, "EVENT" if m.rid in seen else NO_EVENT, ""))
        elif m.expect == "anon":
            ev = next(anon_iter, None)
            out.append((m.kind, outcome_of(ev) if ev else MISSING, ""))
    out.extend(("unexpected_anon_event", outcome_of(ev), ev.error.message[:200]) for ev in anon_iter)
    return out


async def run_all(stack: Stack, calls: list[Call]) -> list[tuple[Call, Result]]:
    sem = asyncio.Semaphore(CONCURRENCY)
    channels = {name: grpc.aio.insecure_channel(g.address) for name, g in stack.gateways.items()}

    async def one(call: Call) -> list[tuple[Call, Result]]:
        async with sem:
            ch = channels[call.gateway]
            res = await (run_bidi_call(ch, call) if call.rpc == "bidi" else run_stream_call(ch, call))
            return [(call, r) for r in res]

    try:
        done = await asyncio.gather(*(one(c) for c in calls))
    finally:
        for ch in channels.values():
            await ch.close()
    return [r for rs in done for r in rs]


def allowed_for(call: Call, kind: str) -> frozenset[str]:
    if call.rpc == "bidi" and kind == call.kind:
        return call.allowed
    for m in call.messages:
        if m.kind == kind and m.expect != "ignore":
            return m.allowed
    return frozenset()  # unexpected_anon_event


def test_fuzz_requests_get_precise_statuses_and_workers_survive(stack: Stack) -> None:
    rng = random.Random(SEED)
    calls = select_kinds(build_calls(rng), os.environ.get("DRAFTWISE_FUZZ_KINDS", ""))
    watch = Stopwatch()
    results = asyncio.run(run_all(stack, calls))
    took = watch()
    counts: Counter[tuple[str, str]] = Counter((kind, outcome) for _, (kind, outcome, _) in results)
    bad = [
        (kind, outcome, note, call.gateway, call.rpc)
        for call, (kind, outcome, note) in results
        if outcome not in allowed_for(call, kind)
    ]
    cases = sum(1 for _, (kind, _, _) in results if kind != "stream_end")
    print(f"\n{cases} cases ({len(calls)} calls) in {took:.1f} s\n")
    print(format_table(counts, "case kind"))
    allowed = {}
    for call, (kind, _, _) in results:
        allowed.setdefault(kind, sorted(allowed_for(call, kind)))
    print("\nallowed: " + "; ".join(f"{k}: {'/'.join(v)}" for k, v in sorted(allowed.items())))
    worst = Counter((k, o, g, rpc) for k, o, _, g, rpc in bad)
    try:
        idle = assert_survived(stack)
        survival = f"workers idle {idle * 1e3:.0f} ms after the last response; same PIDs; a normal request served"
    except AssertionError as e:
        idle, survival = None, f"WORKERS DID NOT SURVIVE: {str(e)[:3000]}"
    print(survival)
    assert not bad, f"{len(bad)} responses outside the allowed statuses: {worst.most_common(30)}; e.g. {bad[:10]}"
    assert idle is not None, survival
    assert cases >= MIN_CASES or os.environ.get("DRAFTWISE_FUZZ_KINDS")
