"""Mid-stream failover and resumable streams with real processes: a worker killed (kill -9) or
drained mid-stream moves its requests to another worker, and the client sees the undisturbed
run's tokens and text with no error, gap or duplicate; the max-failovers limit; a client whose
call went away resumes on a new channel and gets exactly the rest; past the retention time the
request is forgotten and a resume gets NOT_FOUND. A request whose client went away is paused
meanwhile: the worker holds nothing for it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from draftwise.v1 import generate_service_pb2 as gspb
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc
from draftwise.v1 import worker_service_pb2 as wpb
from draftwise.v1 import worker_service_pb2_grpc as wgrpc
from draftwise.worker import SamplingParams
from tests.integration.conftest import reference_outputs
from tests.integration.procs import ServeProc, child_env, metrics_port, start_gateway, start_workers
from tests.integration.rpc import Result, start, start_req, wait_workers_idle, worker_loads, worker_metadata

N_TOKENS = 80
LONG = 440  # tokens of a request that must outlive a drain's detection (the context is 512)
GREEDY = {"max_tokens": N_TOKENS, "ignore_eos": True, "temperature": 0}
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "def quicksort(items):", "import os\n"]
RETENTION_S = 4.0


@pytest.fixture(scope="module")
def cluster(proc_dir):
    workers = start_workers(3, proc_dir, prefix="fo")
    gateways = []
    try:
        flags = ("--failover-wait-s=5", "--failover-stall-s=2", f"--resume-retention-s={RETENTION_S:g}")
        gateways.append(start_gateway(workers, proc_dir, "gateway-fo", *flags))
        gateways.append(start_gateway(workers, proc_dir, "gateway-fo0", "--max-failovers=0", *flags))
    except BaseException:
        for p in workers + gateways:
            p.kill()
        raise
    yield workers, gateways[0], gateways[1]
    for p in gateways + workers:
        p.kill()


@pytest.fixture(scope="module")
def reference(reference_llm):
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = reference_outputs(reference_llm, PROMPTS, params)
    return {p: (o.outputs[0].token_ids, o.outputs[0].text) for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
def reference_long(reference_llm):
    """As ``reference``, for requests of LONG tokens."""
    params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
    outs = reference_outputs(reference_llm, PROMPTS, params)
    return {p: (o.outputs[0].token_ids, o.outputs[0].text) for p, o in zip(PROMPTS, outs, strict=True)}


def _counter(gateway, name: str) -> float:
    """The sum of a metric's samples; ``name`` may include labels (exactly as exposed)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(gateway)}/metrics", timeout=5).read().decode()
    labels = "" if "{" in name else r"(?:\{[^}]*\})?"
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{labels} (\S+)$", text, re.M))


async def _busy_worker(workers):
    """A worker with requests running."""
    loads = await worker_loads([w.address for w in workers])
    return next(w for w, lo in zip(workers, loads, strict=True) if lo.num_requests_running)


async def _stream_with_disruption(gateway, disrupt, params=GREEDY) -> dict[str, Result]:
    """All PROMPTS on one Generate stream; ``disrupt()`` once each has a few tokens."""
    async with grpc.aio.insecure_channel(gateway.address) as ch:
        call = gsgrpc.GenerateServiceStub(ch).Generate(timeout=120)
        results = {p: Result(p) for p in PROMPTS}
        for p in PROMPTS:
            await call.write(start_req(start(p, p, **params)))
        while not all(len(r.token_ids) >= 3 for r in results.values()):
            ev = (await call.read()).event
            results[ev.request_id].add(ev)
        await disrupt()
        await call.done_writing()
        while (resp := await call.read()) != grpc.aio.EOF:
            results[resp.event.request_id].add(resp.event)
        assert await call.code() == grpc.StatusCode.OK
    return results


def _longest_gap_ms(results) -> float:
    """The longest wait between two deltas of one request (the failover's cost, for the report)."""
    gaps = [b - a for r in results.values() for a, b in zip(r.delta_times, r.delta_times[1:], strict=False)]
    return max(gaps) * 1000


def _assert_undisturbed(results, reference, n_tokens=N_TOKENS):
    for p, r in results.items():
        assert r.kind == "finished", (p, r.final)
        ids, text = reference[p]
        assert r.token_ids == ids, p
        assert r.text == text, p
        usage = r.final.finished.usage
        assert usage.completion_tokens == n_tokens and usage.prompt_tokens > 0


def test_resume_on_a_new_channel_gets_exactly_the_rest(cluster, reference):
    workers, gateway, _ = cluster
    prompt = PROMPTS[0]

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:  # the first connection
            call = gsgrpc.GenerateServiceStub(ch).GenerateStream(
                gspb.GenerateStreamRequest(start=start("", prompt, **GREEDY)), timeout=60
            )
            first = Result("first")
            handle = ""
            while len(first.token_ids) < 5:
                ev = (await call.read()).event
                handle = handle or ev.delta.resume_handle
                first.add(ev)
            call.cancel()  # the connection "drops"
        assert len(handle) >= 22  # 128 random bits, url-safe
        async with grpc.aio.insecure_channel(gateway.address) as ch:  # a new one
            stub = gsgrpc.GenerateServiceStub(ch)
            resume = gspb.ResumeGeneration(resume_handle=handle, next_token_index=len(first.token_ids))
            rest = Result("rest")
            rest.token_ids = list(first.token_ids)  # so that its index check continues
            async for resp in stub.GenerateStream(gspb.GenerateStreamRequest(resume=resume), timeout=60):
                rest.add(resp.event)
            # over the multiplexed stream too, from 0, under another id: everything again
            again = Result("again")
            call = stub.Generate(timeout=60)
            await call.write(
                gspb.GenerateRequest(resume=gspb.ResumeGeneration(resume_handle=handle, request_id="again"))
            )
            await call.done_writing()
            async for resp in call:
                assert resp.event.request_id == "again"
                again.add(resp.event)
        return first, rest, again

    first, rest, again = asyncio.run(main())
    ids, text = reference[prompt]
    assert rest.kind == "finished" and rest.token_ids == ids
    assert first.text + rest.text == text
    # the request finished and was delivered: the second resume finds nothing
    assert again.code == grpc.StatusCode.NOT_FOUND and "resume handle" in again.final.error.message


def test_client_continuation_through_the_gateway(cluster, reference):
    """StartGeneration.continuation on the public API: the worker goes on from it (index, tokens
    and text as the undisturbed run's); a finished continuation is INVALID_ARGUMENT."""
    _, gateway, _ = cluster
    prompt = PROMPTS[3]
    ids, text = reference[prompt]

    async def main():
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            s = start("", prompt, **GREEDY)
            s.continuation.output_token_ids.extend(ids[:10])
            got = Result("c")
            got.token_ids = list(ids[:10])
            async for resp in stub.GenerateStream(gspb.GenerateStreamRequest(start=s), timeout=60):
                got.add(resp.event)
            s.continuation.output_token_ids.extend(ids[10:])  # all N_TOKENS: nothing left
            try:
                await stub.GenerateStream(gspb.GenerateStreamRequest(start=s), timeout=10).read()
                return got, grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as e:
                return got, e.code(), e.details()

    got, code, details = asyncio.run(main())
    assert got.token_ids == ids and got.final.finished.usage.completion_tokens == N_TOKENS
    assert got.text and text.endswith(got.text)  # the rest of the text, none of it sent twice
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "already finished" in details


def test_resume_errors_and_retention(cluster):
    workers, gateway, _ = cluster
    addresses = [w.address for w in workers]

    async def main():
        await wait_workers_idle(addresses, timeout=30)
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            call = stub.Generate(timeout=60)
            await call.write(start_req(start("r", PROMPTS[1], max_tokens=400, ignore_eos=True, temperature=0)))
            got, handle, sizes = Result("r"), "", []
            while len(got.token_ids) < 4:
                ev = (await call.read()).event
                handle = handle or ev.delta.resume_handle
                got.add(ev)
                sizes.append(len(ev.delta.token_ids))
            call.cancel()
            # the client went away; its request is kept for a resume, paused: the worker drops it
            # (hundreds of tokens to go) and the gateway keeps its tokens
            paused_idle_s = await wait_workers_idle(addresses, timeout=30)
        codes = {}
        async with grpc.aio.insecure_channel(gateway.address) as ch:
            stub = gsgrpc.GenerateServiceStub(ch)
            for name, resume in {
                "unknown": gspb.ResumeGeneration(resume_handle="x" * 22),
                "beyond": gspb.ResumeGeneration(resume_handle=handle, next_token_index=100000),
            }.items():
                try:
                    await stub.GenerateStream(gspb.GenerateStreamRequest(resume=resume), timeout=10).read()
                    codes[name] = (grpc.StatusCode.OK, "")
                except grpc.aio.AioRpcError as e:
                    codes[name] = (e.code(), e.details())
            await asyncio.sleep(RETENTION_S + 1.0)  # the retention passes: forgotten
            try:
                resume = gspb.ResumeGeneration(resume_handle=handle, next_token_index=len(got.token_ids))
                await stub.GenerateStream(gspb.GenerateStreamRequest(resume=resume), timeout=10).read()
                codes["expired"] = (grpc.StatusCode.OK, "")
            except grpc.aio.AioRpcError as e:
                codes["expired"] = (e.code(), e.details())
        return codes, paused_idle_s

    codes, paused_idle_s = asyncio.run(main())
    print(f"\nworkers idle {paused_idle_s:.3f} s after the client went away")  # wait_workers_idle bounds it (30 s)
    assert codes["unknown"][0] == grpc.StatusCode.NOT_FOUND
    assert codes["beyond"][0] == grpc.StatusCode.INVALID_ARGUMENT and "beyond" in codes["beyond"][1]
    assert codes["expired"][0] == grpc.StatusCode.NOT_FOUND and "retention" in codes["expired"][1]


def test_drain_moves_requests(cluster, reference_long):
    """A drained worker's requests move mid-stream to the others and end exactly as the
    undisturbed run. LONG requests: the gateway sees a drain only at its next load poll, and
    the drained worker must not have finished its requests by then."""
    workers, gateway, _ = cluster
    drained = []

    async def disrupt():
        w = await _busy_worker(workers)
        async with grpc.aio.insecure_channel(w.address) as ch:
            await wgrpc.WorkerServiceStub(ch).Drain(wpb.DrainRequest(), timeout=5, metadata=worker_metadata())
        drained.append(w)

    before = _counter(gateway, "draftwise_failovers_total")
    try:
        results = asyncio.run(_stream_with_disruption(gateway, disrupt, {**GREEDY, "max_tokens": LONG}))
        _assert_undisturbed(results, reference_long, LONG)
        assert _counter(gateway, "draftwise_failovers_total") > before
        print(f"drain: longest gap between deltas {_longest_gap_ms(results):.0f} ms")
        assert _counter(gateway, "draftwise_failover_recomputed_tokens_total") > 0
    finally:
        for w in drained:
            asyncio.run(_undrain(w))


async def _undrain(w):
    async with grpc.aio.insecure_channel(w.address) as ch:
        await wgrpc.WorkerServiceStub(ch).Drain(wpb.DrainRequest(resume=True), timeout=5, metadata=worker_metadata())
    await asyncio.sleep(1.5)  # the gateways' polls see it again


def test_max_failovers_ends_unavailable_saying_tokens_delivered(cluster):
    workers, _, gateway0 = cluster
    drained = []

    async def main():
        async with grpc.aio.insecure_channel(gateway0.address) as ch:
            # long enough that the drained worker cannot finish it before the gateway's next load
            # poll (every 0.5 s) sees the drain, however loaded the machine
            call = gsgrpc.GenerateServiceStub(ch).GenerateStream(
                gspb.GenerateStreamRequest(start=start("", PROMPTS[2], **{**GREEDY, "max_tokens": LONG})), timeout=120
            )
            got = Result("x")
            while len(got.token_ids) < 3:
                got.add((await call.read()).event)
            w = await _busy_worker(workers)
            async with grpc.aio.insecure_channel(w.address) as wch:
                await wgrpc.WorkerServiceStub(wch).Drain(wpb.DrainRequest(), timeout=5, metadata=worker_metadata())
            drained.append(w)
            try:
                while (resp := await call.read()) != grpc.aio.EOF:
                    got.add(resp.event)
                return grpc.StatusCode.OK, "", got
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details(), got

    try:
        code, details, got = asyncio.run(main())
    finally:
        for w in drained:
            asyncio.run(_undrain(w))
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    n = len(got.token_ids)
    assert 0 < n < LONG and f"{n} output tokens were delivered" in details and "--max-failovers=0" in details


def test_hung_worker_is_left_after_the_stall_time(cluster, reference):
    """A worker that stops making progress (SIGSTOP: its process hangs) loses its requests
    after --failover-stall-s; they go on elsewhere, exactly."""
    workers, gateway, _ = cluster
    stopped = []

    async def disrupt():
        w = await _busy_worker(workers)
        os.kill(w.popen.pid, signal.SIGSTOP)
        stopped.append(w)

    before = _counter(gateway, 'draftwise_failovers_total{reason="stall"}')
    try:
        results = asyncio.run(_stream_with_disruption(gateway, disrupt))
    finally:
        for w in stopped:
            os.kill(w.popen.pid, signal.SIGCONT)
    _assert_undisturbed(results, reference)
    assert _counter(gateway, 'draftwise_failovers_total{reason="stall"}') > before
    asyncio.run(asyncio.sleep(2.5))  # the hung worker comes back into rotation


def test_draftwise_generate_survives_kill_9_of_its_only_worker(tmp_path, reference_llm):
    """``draftwise generate --server`` against ``draftwise serve --workers 1``: the worker
    serving it is killed mid-stream, the supervisor restarts it, the request fails over to the
    restarted worker and the text streams on: exactly the undisturbed text, exit status 0."""
    prompt, n = "def fibonacci(n):", 450  # far from done when killed (the context is 512)
    serve = ServeProc(tmp_path, "--failover-wait-s=60", workers=1).wait_listening()
    try:
        cmd = [sys.executable, "-m", "draftwise.cli", "generate", prompt, "--server", serve.address]
        cmd += [f"--max-tokens={n}", "--ignore-eos", "--timeout=120"]
        gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), text=True)
        deadline = time.monotonic() + 60
        while serve.metrics().get("draftwise_generation_tokens_total", 0) < 5:
            assert time.monotonic() < deadline and gen.poll() is None, gen.stderr.read() if gen.poll() else ""
            time.sleep(0.05)
        (pid,) = serve.worker_pids()
        os.kill(pid, signal.SIGSTOP)  # frozen: it cannot finish the request before the kill
        running, served = gen.poll() is None, serve.metrics()["draftwise_generation_tokens_total"]
        os.kill(pid, signal.SIGKILL)
        assert running and served < n, (running, served)  # the kill cut the request short
        out, err = gen.communicate(timeout=120)
        failovers = serve.metrics().get('draftwise_failovers_total{reason="unavailable"}', 0)
    finally:
        serve.close()
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    (ref,) = reference_outputs(reference_llm, [prompt], params)
    assert gen.returncode == 0, err
    assert out == prompt + ref.outputs[0].text + "\n"
    assert failovers >= 1


def test_kill_9_mid_stream_continues_token_for_token(cluster, reference):
    """Last: it kills a worker."""
    workers, gateway, _ = cluster

    async def disrupt():
        (await _busy_worker(workers)).kill()

    before = _counter(gateway, "draftwise_failovers_total")
    results = asyncio.run(_stream_with_disruption(gateway, disrupt))
    _assert_undisturbed(results, reference)
    assert _counter(gateway, "draftwise_failovers_total") > before
    print(f"kill -9: longest gap between deltas {_longest_gap_ms(results):.0f} ms")
