"""Chaos: worker kills and dropped client connections lose no token.

A real ``draftwise serve --workers 3 --speculative-model default`` runs 200 streams: greedy
and seeded sampled, with speculation on and off (per request), over ``GenerateStream`` (one
call per request) and ``Generate`` (sessions of several requests on one stream), all through
the Python client. The same 200 requests run once undisturbed (the reference), then again
(in as many passes as it takes for 5 kills to fit, each checked on its own) while a random busy worker is SIGKILLed at random times (at least 5 kills; never all
three down at once, the supervisor restarts them) and 20 client connections are reset mid-stream by a TCP
proxy on 127.0.0.1 (the client resumes them). Every stream must end with exactly the tokens
and text of its reference run, in contiguous deltas (0 lost, 0 duplicated), with no error
the caller sees; afterwards every worker holds no KV block and runs nothing.

Run with ``-s`` to see the figures (recorded in docs/reliability.md, "Chaos")."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from draftwise.hop import read_secret_file
from tests.integration.procs import CLIENT_DIR, ServeProc
from tests.integration.rpc import worker_loads
from tests.integration.tcp_proxy import TcpProxy

sys.path.insert(0, str(CLIENT_DIR))
from draftwise_client import AsyncClient, Delta, GenerationError, ResumePolicy, SamplingParams  # noqa: E402

SEED = 1111
"""Seed of the plan (prompts, lengths, seeds, which connections drop, kill times)."""
NUM_STREAMS = 200
SESSION_SIZE = 5
"""Requests per Generate stream (session); half of the streams go over sessions."""
NUM_DROPS = 20
"""Client connections reset mid-stream (10 GenerateStream calls, 10 sessions)."""
MIN_KILLS = 5
MAX_CHAOS_PASSES = 8
"""The chaos run repeats (each pass checked against the reference on its own) until the
kills add up to MIN_KILLS: on a fast machine one pass of the 200 streams ends before five
kills fit, since a killed worker needs wall-clock seconds to come back whatever the speed."""
MAX_TOKENS = (32, 64)
IN_FLIGHT = 24
"""Connections (GenerateStream calls or sessions) open at once."""
KILL_AT = (0.04, 0.14, 0.26, 0.38, 0.5, 0.62, 0.74)
"""Kills fall due as these shares of the streams have ended (spread over the run whatever the
machine's speed), each at a random moment up to KILL_JITTER_S later, at least MIN_KILL_GAP_S
after the previous one, on a random worker that is running requests, and only while at least
two workers serve (never all three down at once)."""
KILL_JITTER_S = 1.0
MIN_KILL_GAP_S = 2.0
"""Seconds at least between two kills."""
PROMPTS = (
    "def fibonacci(n):",
    "class Stack:",
    "import os\n\n\ndef list_files(path):",
    "The quick brown fox",
    "SELECT name FROM users WHERE",
    "# Binary search\ndef search(items, x):",
)
RESUME = ResumePolicy(max_attempts=8, initial_backoff_s=0.02, max_backoff_s=0.5)
SERVE_FLAGS = ("--speculative-model=default", "--max-in-flight=512")
"""The gateway's default --max-failovers: kills every few seconds catch some requests three times
or more over a run (a request waits and moves with its worker's whole batch); the bound counts
only moves in a row after which the new worker sent no token, so a request that makes progress
on each worker it lands on is never ended by it."""
IDLE_TIMEOUT_S = 30.0
"""Seconds the last killed worker gets to come back and every worker to show no KV block held."""


@dataclass(frozen=True)
class Req:
    index: int
    prompt: str
    params: SamplingParams
    kind: str  # "greedy" | "seeded"

    @property
    def label(self) -> str:
        spec = "spec" if self.params.speculation else "nospec"
        return f"{self.index}:{self.kind}/{spec}"


@dataclass(frozen=True)
class Unit:
    """One client connection: a GenerateStream call (one request) or a session (several)."""

    api: str  # "stream" | "session"
    reqs: tuple[Req, ...]
    drop_after: int | None  # tokens received (by its first request) before the reset; None: never


@dataclass
class Outcome:
    deltas: list[Delta] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: str | None = None
    resumes: int = 0


def plan(rng: random.Random) -> list[Unit]:
    reqs = []
    for i in range(NUM_STREAMS):
        kind = "greedy" if i % 2 == 0 else "seeded"
        temp = {"temperature": 0.0} if kind == "greedy" else {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i}
        params = SamplingParams(
            max_tokens=rng.randint(*MAX_TOKENS), ignore_eos=True, speculation=(i // 2) % 2 == 0, **temp
        )
        reqs.append(Req(i, rng.choice(PROMPTS), params, kind))
    rng.shuffle(reqs)
    half = NUM_STREAMS // 2
    units = [Unit("stream", (r,), None) for r in reqs[:half]]
    units += [Unit("session", tuple(reqs[i : i + SESSION_SIZE]), None) for i in range(half, NUM_STREAMS, SESSION_SIZE)]
    drops = rng.sample([i for i, u in enumerate(units) if u.api == "stream"], NUM_DROPS // 2)
    drops += rng.sample([i for i, u in enumerate(units) if u.api == "session"], NUM_DROPS // 2)
    for i in drops:
        u = units[i]
        units[i] = Unit(u.api, u.reqs, rng.randint(1, min(r.params.max_tokens for r in u.reqs) // 2))
    rng.shuffle(units)
    return units


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    s = ServeProc(tmp_path_factory.mktemp("chaos"), *SERVE_FLAGS, workers=3).wait_listening()
    yield s
    s.close()


async def _consume(stream: object, req: Req, out: Outcome, proxy: TcpProxy | None, drop_after: int | None) -> None:
    try:
        async for d in stream:  # type: ignore[attr-defined]
            out.deltas.append(d)
            out.times.append(time.monotonic())
            received = sum(len(x.token_ids) for x in out.deltas)
            if proxy is not None and drop_after is not None and not proxy.drops and received >= drop_after:
                await asyncio.to_thread(proxy.drop)
    except GenerationError as e:
        out.error = f"{e.code.name}: {e.message}"


async def run_unit(address: str, unit: Unit, outcomes: dict[int, Outcome], chaos: bool) -> int:
    """Run one connection's requests; returns the connections reset under it."""
    proxy = TcpProxy(int(address.rsplit(":", 1)[1])) if chaos and unit.drop_after is not None else None
    target = proxy.address if proxy else address
    try:
        async with AsyncClient(target, resume=RESUME) as client:
            if unit.api == "stream":
                (req,) = unit.reqs
                out = outcomes[req.index] = Outcome()
                await _consume(client.generate(req.prompt, req.params, timeout=120), req, out, proxy, unit.drop_after)
            else:
                async with client.session(timeout=120) as s:
                    streams = [await s.generate(r.prompt, r.params) for r in unit.reqs]
                    outs = [outcomes.setdefault(r.index, Outcome()) for r in unit.reqs]
                    drops = [unit.drop_after] + [None] * (len(unit.reqs) - 1)
                    await asyncio.gather(
                        *(
                            _consume(st, r, o, proxy, d)
                            for st, r, o, d in zip(streams, unit.reqs, outs, drops, strict=True)
                        )
                    )
                    for st, o in zip(streams, outs, strict=True):
                        o.resumes = st.resumes
        return proxy.drops if proxy else 0
    finally:
        if proxy:
            proxy.close()


@dataclass
class Killer:
    serve: ServeProc
    rng: random.Random
    kills: list[tuple[float, str]] = field(default_factory=list)
    secret: str = ""

    async def _busy_workers(self) -> list[tuple[str, int]]:
        ready = self.serve.ready_workers()
        alive = self.serve.worker_pids()
        names = sorted(n for n, e in ready.items() if int(e["pid"]) in alive)
        if len(names) < 2:
            return []  # two are still coming back: never all three down at once
        try:
            loads = await worker_loads([ready[n]["address"] for n in names], self.secret)
        except Exception:  # a worker on its way out
            return []
        return [(n, int(ready[n]["pid"])) for n, lo in zip(names, loads, strict=True) if lo.num_requests_running]

    async def run(self, stop: asyncio.Event, ended: Callable[[], float]) -> None:
        """Kill as KILL_AT says; ``ended`` is the share of the streams that have ended."""
        for share in KILL_AT:
            while ended() < share and not stop.is_set():
                await asyncio.sleep(0.05)
            await asyncio.sleep(self.rng.uniform(0, KILL_JITTER_S))
            if self.kills:
                await asyncio.sleep(max(0.0, self.kills[-1][0] + MIN_KILL_GAP_S - time.monotonic()))
            while not stop.is_set():
                busy = await self._busy_workers()
                if busy:
                    break
                await asyncio.sleep(0.05)
            if stop.is_set():
                return
            name, pid = self.rng.choice(busy)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                self.kills.append((time.monotonic(), name))


async def run_all(serve: ServeProc, units: list[Unit], killer: Killer | None = None) -> tuple[dict[int, Outcome], int]:
    """One pass over every unit (the chaos kind when ``killer`` is given); returns the outcomes
    by request and the connections reset."""
    outcomes: dict[int, Outcome] = {}
    gate = asyncio.Semaphore(IN_FLIGHT)
    stop = asyncio.Event()

    def ended() -> float:
        return sum(1 for o in outcomes.values() if o.error or (o.deltas and o.deltas[-1].finished)) / NUM_STREAMS

    kill_task = asyncio.create_task(killer.run(stop, ended)) if killer else None

    async def one(unit: Unit) -> int:
        async with gate:
            return await run_unit(serve.address, unit, outcomes, chaos=killer is not None)

    drops = sum(await asyncio.gather(*(one(u) for u in units)))
    stop.set()
    if kill_task is not None:
        await kill_task
    return outcomes, drops


async def wait_idle(serve: ServeProc, secret: str, timeout: float) -> float:
    """Seconds until all 3 workers are up and hold no KV block and run nothing."""
    t0 = time.monotonic()
    last: object = None
    while time.monotonic() - t0 < timeout:
        ready = serve.ready_workers()
        alive = serve.worker_pids()
        up = [e["address"] for e in ready.values() if int(e["pid"]) in alive]
        if len(up) == 3:
            with contextlib.suppress(Exception):
                loads = await worker_loads(up, secret)
                last = loads
                if all(
                    lo.num_free_kv_blocks == lo.num_total_kv_blocks
                    and not lo.num_requests_running
                    and not lo.num_requests_waiting
                    for lo in loads
                ):
                    return time.monotonic() - t0
        await asyncio.sleep(0.1)
    raise AssertionError(f"workers not idle after {timeout} s: {last}")


def check(units: list[Unit], outcomes: dict[int, Outcome], reference: dict[int, Outcome]) -> list[str]:
    """Every way a stream differs from its reference (empty: all exact)."""
    problems = []
    for unit in units:
        for r in unit.reqs:
            out, ref = outcomes.get(r.index), reference[r.index]
            if out is None or out.error:
                problems.append(f"{r.label}: error {out.error if out else 'never ran'}")
                continue
            n = 0
            for d in out.deltas[:-1]:
                if d.first_token_index != n:
                    problems.append(f"{r.label}: delta at {d.first_token_index} after {n} tokens")
                n += len(d.token_ids)
            last = out.deltas[-1] if out.deltas else None
            if last is None or last.finish_reason != "length" or last.usage.completion_tokens != r.params.max_tokens:
                problems.append(f"{r.label}: ended {last}")
            ids = [t for d in out.deltas for t in d.token_ids]
            ref_ids = [t for d in ref.deltas for t in d.token_ids]
            if ids != ref_ids:
                lost = max(0, len(ref_ids) - len(ids))
                problems.append(f"{r.label}: tokens differ ({len(ids)} vs {len(ref_ids)}, {lost} missing)")
            if "".join(d.text for d in out.deltas) != "".join(d.text for d in ref.deltas):
                problems.append(f"{r.label}: text differs")
    return problems


def summarize(problems: list[str]) -> str:
    """Problems counted by stream kind and what went wrong ("seeded/spec: error UNAVAILABLE": 3)."""
    counts = Counter(" ".join(p.split(":", 1)[1].replace(":", "").split()[:3]) for p in problems)
    streams = len({p.split(":", 1)[0] for p in problems})
    return f"{streams} streams with problems: " + ", ".join(f"{k}: {n}" for k, n in sorted(counts.items()))


def failover_gaps(outcomes: dict[int, Outcome], kills: list[tuple[float, str]]) -> list[float]:
    """For each stream and kill: the gap between the deltas on either side of the kill
    (the stream's pause across it), for streams that were mid-way at the kill."""
    gaps = []
    for out in outcomes.values():
        for t, _ in kills:
            before = [x for x in out.times if x <= t]
            after = [x for x in out.times if x > t]
            if before and after and len(after) > 1:  # not just the final event
                gaps.append(after[0] - before[-1])
    return gaps


def gateway_figures(serve: ServeProc) -> dict[str, float]:
    """Gateway metrics about failover and resume (names as the gateway exports them)."""
    words = ("failover", "recomput", "resum", "replay", "detached")
    return {
        k: v
        for k, v in serve.metrics().items()
        if any(w in k for w in words) and not k.split("{", 1)[0].endswith("_created")
    }


def test_chaos(serve):
    secret = read_secret_file(serve.secret_file())  # before any worker is killed
    rng = random.Random(SEED)
    units = plan(rng)
    assert sum(len(u.reqs) for u in units) == NUM_STREAMS
    assert sum(u.drop_after is not None for u in units) == NUM_DROPS

    t0 = time.monotonic()
    reference, _ = asyncio.run(run_all(serve, units))
    ref_s = time.monotonic() - t0
    ref_errors = {i: o.error for i, o in reference.items() if o.error}
    assert not ref_errors, f"the undisturbed run failed: {ref_errors}"
    before = gateway_figures(serve)

    killer = Killer(serve, random.Random(SEED + 1), secret=secret)
    passes: list[tuple[dict[int, Outcome], int]] = []
    t0 = time.monotonic()
    while len(killer.kills) < MIN_KILLS and len(passes) < MAX_CHAOS_PASSES:
        passes.append(asyncio.run(run_all(serve, units, killer)))
    chaos_s = time.monotonic() - t0
    idle_s = asyncio.run(wait_idle(serve, secret, IDLE_TIMEOUT_S))
    after = gateway_figures(serve)

    problems = [
        f"{n + 1}/{p}" if len(passes) > 1 else p  # "2/17:greedy/spec: ...": pass 2, request 17
        for n, (outcomes, _) in enumerate(passes)
        for p in check(units, outcomes, reference)
    ]
    gaps = [g for outcomes, _ in passes for g in failover_gaps(outcomes, killer.kills)]
    ref_gaps = [b - a for o in reference.values() for a, b in zip(o.times, o.times[1:], strict=False)]
    resumed_requests = sum(1 for outcomes, _ in passes for o in outcomes.values() if o.resumes) + sum(
        1  # a GenerateStream call whose connection was reset and that still completed
        for outcomes, _ in passes
        for u in units
        if u.api == "stream" and u.drop_after is not None and not outcomes[u.reqs[0].index].error
    )
    drops = [d for _, d in passes]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    print(
        f"\nchaos: {NUM_STREAMS} streams ({len(units)} connections) x {len(passes)} passes, {len(killer.kills)} kills "
        f"({', '.join(n for _, n in killer.kills)}), {sum(drops)} connections reset, "
        f"{resumed_requests} requests resumed, {len(problems)} problems"
    )
    print(f"undisturbed run {ref_s:.1f} s, chaos run {chaos_s:.1f} s; workers idle {idle_s:.2f} s after")
    for k, v in sorted(delta.items()):
        print(f"  {k} += {v:g}")
    if gaps:
        print(
            f"pause across a kill, {len(gaps)} stream-kills: median {statistics.median(gaps) * 1000:.0f} ms, "
            f"p90 {sorted(gaps)[int(len(gaps) * 0.9)] * 1000:.0f} ms, max {max(gaps) * 1000:.0f} ms "
            f"(undisturbed inter-delta gap: median {statistics.median(ref_gaps) * 1000:.0f} ms, "
            f"max {max(ref_gaps) * 1000:.0f} ms)"
        )
    assert not problems, summarize(problems) + "\n" + "\n".join(problems[:40])
    assert len(killer.kills) >= MIN_KILLS, killer.kills
    assert drops == [NUM_DROPS] * len(passes)
