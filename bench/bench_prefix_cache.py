"""Prefix caching and cache-aware routing (issue 26) through real processes (client -> gateway ->
worker processes, gRPC on 127.0.0.1), every figure against a reference measured in the same run:

1. ``system``: requests sharing a 1,000-token system prompt (+ a 16-48-token suffix each), 8 closed-loop
   clients, one worker with prefix caching on against one with ``--no-enable-prefix-caching``;
2. ``conversation``: 4 conversations of 10 turns replayed turn by turn, caching on against off;
3. ``routing``: 8 distinct 600-token prefixes x 8 requests, shuffled, on 2 workers behind ``--routing
   prefix`` and behind ``--routing least-loaded``, and on one worker (the reference hit rate);
4. ``speculation``: the ``system`` workload with n-gram speculation (and the embedded draft model for
   the embedded target): hit rates against the one without speculation.

    python bench/bench_prefix_cache.py [--model MODEL] [--parts system,conversation,routing,speculation]
        [--requests 64] [--rounds 2] [--threads 1] [--no-publish]

Results: docs/benchmarks.md (section ``prefix-cache``) and bench/results/prefix_cache.json (another
``--model``: ``prefix-cache-<model>``, prefix_cache_<model>.json); ``--no-publish`` only prints them.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import namedtuple
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
import uvloop
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

from draftwise.hop import generate_secret, write_secret_file  # noqa: E402
from draftwise.v1 import generate_service_pb2 as gspb  # noqa: E402
from draftwise.v1 import generate_service_pb2_grpc as gsgrpc  # noqa: E402
from draftwise.v1 import generation_pb2 as pb  # noqa: E402
from draftwise.worker.paths import resolve_model  # noqa: E402
from draftwise.worker.text.tokenizer import load_tokenizer  # noqa: E402

PARTS = ("system", "conversation", "routing", "speculation")
NEW_TOKENS, SYSTEM_TOKENS, SUFFIX = 32, 1000, (16, 48)
FIRST_TURN, USER_LINE, PREFIX_TOKENS, ROUTE_SUFFIX = 200, 24, 600, 16
ENGINE = {"max_model_len": 2048, "max_num_seqs": 32, "num_kv_blocks": 1024}
"""Every worker's settings: 16,384 tokens of KV (16-token blocks), far more than a round holds at once."""
QUERIES = ("draftwise_prefix_cache_queries_total", "worker")  # gateway metric, by label
DECISIONS = ("draftwise_routing_decisions_total", "outcome")
POLL_S = 0.5  # the gateways' GetLoad poll: their per-worker counters are as of the last one


Reply = namedtuple("Reply", "ttft_s tokens prompt_tokens cached_tokens")  # one request's, as the client saw it


@dataclass
class Server:
    address: str = ""
    metrics_port: int = 0
    workers: list[str] = field(default_factory=list)


async def one(stub: gsgrpc.GenerateServiceStub, prompt: list[int]) -> Reply:
    """One request over GenerateStream: send -> first token delta, its tokens, its final Usage."""
    start = pb.StartGeneration(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=prompt)))
    start.sampling_params.CopyFrom(pb.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    t, ttft, tokens, usage = time.perf_counter(), None, [], None
    async for resp in stub.GenerateStream(gspb.GenerateStreamRequest(start=start)):
        kind = resp.event.WhichOneof("kind")
        if kind == "delta" and resp.event.delta.token_ids:
            ttft = ttft if ttft is not None else time.perf_counter() - t
            tokens += resp.event.delta.token_ids
        elif kind == "finished":
            usage = resp.event.finished.usage
        elif kind == "error":
            raise RuntimeError(f"request failed: {resp.event.error}")
    if usage is None or ttft is None:
        raise RuntimeError("a request ended without tokens or Usage")
    return Reply(ttft, tokens, usage.prompt_tokens, usage.cached_prompt_tokens)


def summary(replies: list[Reply], seconds: float) -> dict:
    ttft = sorted(1e3 * r.ttft_s for r in replies)
    out, prompt = sum(len(r.tokens) for r in replies), sum(r.prompt_tokens for r in replies)
    cached, misses = sum(r.cached_tokens for r in replies), sum(not r.cached_tokens for r in replies)
    s = {"requests": len(replies), "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": ttft[int(0.99 * len(ttft))]}
    s |= {"output_tokens": out, "seconds": seconds, "tokens_per_s": out / seconds, "prompt_tokens": prompt}
    return s | {"cached_tokens": cached, "hit_rate": cached / prompt, "misses": misses}


async def timed(address: str, n: int, run) -> tuple[dict, list]:
    """``run(stub, replies)``, timed, on one channel to ``address``; its ``n`` replies' summary and tokens."""
    replies: list = [None] * n
    async with grpc.aio.insecure_channel(address) as ch:
        t0 = time.perf_counter()
        await run(gsgrpc.GenerateServiceStub(ch), replies)
        seconds = time.perf_counter() - t0
    return summary(replies, seconds), [r.tokens for r in replies]


async def closed_loop(address: str, prompts: list[list[int]], clients: int, first_alone: bool) -> tuple[dict, list]:
    """``prompts`` sent by ``clients`` closed-loop clients (each sends its next when its last ends);
    ``first_alone``: the first one runs alone before them (it computes the shared prefix)."""
    todo = iter(range(len(prompts)))

    async def run(stub: gsgrpc.GenerateServiceStub, replies: list) -> None:
        async def client() -> None:
            for i in todo:
                replies[i] = await one(stub, prompts[i])

        if first_alone:
            replies[0] = await one(stub, prompts[next(todo)])
        await asyncio.gather(*(client() for _ in range(clients)))

    return await timed(address, len(prompts), run)


async def conversations(address: str, firsts: list[list[int]], lines: list[list[list[int]]]) -> tuple[dict, list]:
    """Every conversation at once, each turn after the last: turn i = turn i-1's prompt + its answer + a line."""
    turns = len(lines[0]) + 1

    async def run(stub: gsgrpc.GenerateServiceStub, replies: list) -> None:
        async def conversation(c: int) -> None:
            prompt = firsts[c]
            for i in range(c * turns, (c + 1) * turns):
                if i > c * turns:
                    prompt = prompt + replies[i - 1].tokens + lines[c][i - c * turns - 1]
                replies[i] = await one(stub, prompt)

        await asyncio.gather(*(conversation(c) for c in range(len(firsts))))

    return await timed(address, len(firsts) * turns, run)


def scraped(port: int, name: str, label: str) -> dict[str, float]:
    """Samples ``name`` of the gateway's Prometheus metrics, by their label ``label``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = (s for f in text_string_to_metric_families(text) for s in f.samples)
    return {s.labels[label]: s.value for s in samples if s.name == name and label in s.labels}


class Cluster:
    """The worker and gateway processes of the run, each with a ready file; ``close`` stops them."""

    def __init__(self, tmp: Path, model: str | None, threads: int) -> None:
        self.tmp, self.procs = tmp, []
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
        secret = write_secret_file(tmp / "internal-secret", generate_secret())
        self.common = ["--log-level=warning", f"--internal-secret-file={secret}", f"--parent-pid={os.getpid()}"]
        engine = ENGINE | ({"model": model} if model else {})
        self.engine = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]

    def spawn(self, name: str, args: list[str]) -> tuple[str, subprocess.Popen]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        argv = [sys.executable, "-m", *args, *self.common, "--ready-file", str(self.tmp / f"{name}.port")]
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=log, env=self.env))
        return name, self.procs[-1]

    def port(self, name: str, p: subprocess.Popen) -> int:
        ready, deadline = self.tmp / f"{name}.port", time.monotonic() + 600
        while not (ready.is_file() and ready.read_text().strip()):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: {(self.tmp / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.1)
        return int(ready.read_text())

    def start(self, specs: dict[str, tuple[int, list[str], str]]) -> dict[str, Server]:
        """Servers by name from (workers, engine flags, routing): every worker at once, then the gateways."""
        worker = ["draftwise.worker.serving.server", "--port=0", *self.engine]
        procs = {n: [self.spawn(f"{n}-w{i}", worker + flags) for i in range(k)] for n, (k, flags, _) in specs.items()}
        servers = {n: Server(workers=[f"127.0.0.1:{self.port(*w)}" for w in ws]) for n, ws in procs.items()}
        gateways = {}
        for n, s in servers.items():
            with socket.socket() as sock:  # a free port for its metrics (the ready file names only the gRPC one)
                sock.bind(("127.0.0.1", 0))
                s.metrics_port = sock.getsockname()[1]
            args = ["draftwise.gateway", "--port=0", f"--routing={specs[n][2]}", f"--metrics-port={s.metrics_port}"]
            gateways[n] = self.spawn(f"{n}-gw", args + [f"--worker={w}" for w in s.workers])
        for n, s in servers.items():
            s.address, deadline = f"127.0.0.1:{self.port(*gateways[n])}", time.monotonic() + 60
            while sum(scraped(s.metrics_port, "draftwise_worker_healthy", "worker").values()) < len(s.workers):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway {n}: workers not healthy: {(self.tmp / f'{n}-gw.log').read_text()}")
                time.sleep(0.2)
        return servers

    def close(self) -> None:
        for p in reversed(self.procs):  # the gateways first
            p.terminate()
            p.wait(30)


def med(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items() if isinstance(v, (int, float))}


def same(a: list, b: list) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def routing_run(s: Server, prompts: list[list[int]], clients: int) -> dict:
    """One routing run, with what the gateway's per-worker counters say of it. The gateway counts no
    requests per worker; a worker counts ``prompt - 1`` looked-up tokens per admission
    (``draftwise_prefix_cache_queries``), so with prompts of one length its requests are its counter's
    growth over that; ``counted`` (their sum) equals the requests unless some were admitted twice."""
    time.sleep(3 * POLL_S)
    q0, d0 = scraped(s.metrics_port, *QUERIES), scraped(s.metrics_port, *DECISIONS)
    result, _ = uvloop.run(closed_loop(s.address, prompts, clients, first_alone=False))
    time.sleep(3 * POLL_S)
    q1, d1 = scraped(s.metrics_port, *QUERIES), scraped(s.metrics_port, *DECISIONS)
    per_worker = [(q1.get(w, 0) - q0.get(w, 0)) / (len(prompts[0]) - 1) for w in s.workers]
    result |= {"requests_per_worker": per_worker, "counted": sum(per_worker)}
    result["largest_share"] = max(per_worker) / (len(prompts) / len(s.workers))
    return result | {"decisions": {k: int(v - d0.get(k, 0)) for k, v in d1.items() if v > d0.get(k, 0)}}


def workloads(tok, a: argparse.Namespace) -> list[dict]:
    """Each round's prompts (token ids, fresh each round): the system part's, the conversations' first
    turns and user lines, the routing part's (shuffled with a fixed seed)."""
    R, N, C, T, P = a.rounds, a.requests, a.conversations, a.turns, a.prefixes

    def cut(n: int, lengths: tuple[int, ...], seed: int, bos: bool = True) -> list[list[int]]:  # held-out windows
        return [p[1 - bos :] for p in bl.heldout_prompts(tok, n, (lengths[0] + 1 - bos, lengths[1] + 1 - bos), seed)]

    systems, suffixes = cut(R, (SYSTEM_TOKENS,) * 2, 1), cut(R * N, SUFFIX, 2, bos=False)
    firsts, user = cut(R * C, (FIRST_TURN,) * 2, 3), cut(R * C * (T - 1), (USER_LINE,) * 2, 4, bos=False)
    prefixes, tails = cut(R * P, (PREFIX_TOKENS,) * 2, 5), cut(R * N, (ROUTE_SUFFIX,) * 2, 6, bos=False)
    rounds = []
    for r in range(R):
        route = [prefixes[r * P + i % P] + tails[r * N + i] for i in range(N)]
        random.Random(7 + r).shuffle(route)
        lines = [user[(r * C + c) * (T - 1) :][: T - 1] for c in range(C)]
        system = [systems[r] + s for s in suffixes[r * N : (r + 1) * N]]
        rounds.append({"system": system, "routing": route, "firsts": firsts[r * C : (r + 1) * C], "lines": lines})
    return rounds


def run_round(r: int, w: dict, servers: dict[str, Server], parts: set, spec: list[str], a, res: dict) -> None:
    """Round ``r`` of every part asked for, on prompts ``w``; its rows appended to ``res``."""
    order = ["on", "off"] if r % 2 == 0 else ["off", "on"]  # the order alternates between rounds

    def add(part: str, row: dict) -> None:
        res.setdefault(part, {"rounds": []})["rounds"].append(row)

    if {"system", "speculation"} & parts:
        names = [n for n in order + spec if n in servers]
        out = {n: uvloop.run(closed_loop(servers[n].address, w["system"], a.clients, True)) for n in names}
        if "system" in parts:
            add("system", {n: out[n][0] for n in order} | {"same_outputs": same(out["on"][1], out["off"][1])})
        if "speculation" in parts:
            add("speculation", {"plain": out["on"][0]} | {n: out[n][0] for n in spec})
            for n in spec:
                res["speculation"]["rounds"][-1][n]["same_outputs"] = same(out["on"][1], out[n][1])
    if "conversation" in parts:
        conv = {n: uvloop.run(conversations(servers[n].address, w["firsts"], w["lines"])) for n in order}
        add("conversation", {n: conv[n][0] for n in order} | {"same_outputs": same(conv["on"][1], conv["off"][1])})
    if "routing" in parts:  # the one-worker reference is the caching-on server: these prompts are new to it
        names = ["prefix", "least-loaded", "one-worker"][r % 3 :] + ["prefix", "least-loaded", "one-worker"][: r % 3]
        add("routing", {n: routing_run(servers.get(n, servers["on"]), w["routing"], a.clients) for n in names})


def summarize(res: dict) -> None:
    """Medians over the rounds and the medians of the per-round ratios, into ``res``."""
    for part in ("system", "conversation"):
        if part in res:
            rows = res[part]["rounds"]
            res[part] |= {n: med([x[n] for x in rows]) for n in ("on", "off")}
            tt = [x["off"]["ttft_p50_ms"] / x["on"]["ttft_p50_ms"] for x in rows]
            tp = [x["on"]["tokens_per_s"] / x["off"]["tokens_per_s"] for x in rows]
            res[part] |= {"ttft_ratios": tt, "throughput_ratios": tp}
            res[part] |= {"ttft_ratio": statistics.median(tt), "throughput_ratio": statistics.median(tp)}
    if "routing" in res:
        rows = res["routing"]["rounds"]
        res["routing"] |= {n: med([x[n] for x in rows]) for n in rows[0]}
        for n in ("prefix", "least-loaded"):
            ratio = statistics.median(x[n]["hit_rate"] / max(x["one-worker"]["hit_rate"], 1e-9) for x in rows)
            res["routing"][n] |= {"vs_one_worker": ratio, "worst_share": max(x[n]["largest_share"] for x in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bl.add_model_argument(ap)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--requests", type=int, default=64, help="requests of the system and routing parts (64)")
    ap.add_argument("--prefixes", type=int, default=8, help="distinct prefixes of the routing part (8)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients of the system and routing parts")
    ap.add_argument("--rounds", type=int, default=2, help="rounds the servers alternate in (fresh prompts each)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    ap.add_argument("--no-publish", action="store_true", help="print the results; write no docs or results file")
    args = ap.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - set(PARTS):
        ap.error(f"--parts: some of {', '.join(PARTS)}")
    if args.rounds < 1 or args.requests < 2 or args.turns < 1 or ("routing" in parts and args.requests % args.prefixes):
        ap.error("need --rounds >= 1, --requests >= 2, --turns >= 1, --requests a multiple of --prefixes")
    torch.set_num_threads(args.threads)  # the machine line's thread count: that of each worker
    model = None if bl.is_default_model(args.model) else args.model
    tok = load_tokenizer(resolve_model(args.model))
    rounds, warm = workloads(tok, args), bl.heldout_prompts(tok, 8, (64, 64), seed=8)

    specs = {"on": (1, [], "prefix")}  # caching on; also the routing part's one-worker reference
    if {"system", "conversation"} & parts:
        specs["off"] = (1, ["--no-enable-prefix-caching"], "prefix")
    if "routing" in parts:
        specs |= {"prefix": (2, [], "prefix"), "least-loaded": (2, [], "least-loaded")}
    spec = {"ngram": ["--speculative-method=ngram"]} if "speculation" in parts else {}
    if spec and model is None:  # the embedded draft model drafts for the embedded target only
        spec["draft"] = ["--speculative-model=default"]
    specs |= {n: (1, f, "prefix") for n, f in spec.items()}

    keys = ("threads", "rounds", "clients", "requests", "prefixes", "conversations", "turns")
    results: dict = {"machine": bl.machine(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "argv": sys.argv[1:]}
    results |= {k: getattr(args, k) for k in keys} | ({"model": model} if model else {})
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp), model, args.threads)
        try:
            t0 = time.monotonic()
            servers = cluster.start(specs)
            print(f"{len(cluster.procs)} processes up in {time.monotonic() - t0:.0f} s", flush=True)
            for s in servers.values():  # warm-up: every worker runs a few requests first
                uvloop.run(closed_loop(s.address, warm, 2 * len(s.workers), first_alone=False))
            for r, w in enumerate(rounds):
                run_round(r, w, servers, parts, list(spec), args, results)
                print(f"round {r + 1}/{args.rounds} done at {time.monotonic() - t0:.0f} s", flush=True)
        finally:
            cluster.close()
    summarize(results)
    text = render(results)
    print(*([json.dumps(results, indent=1)] if args.no_publish else []), text, sep="\n")
    if not args.no_publish:  # a trial run writes nothing
        bl.save_results(bl.for_model("prefix_cache", args.model, "_"), results)
        bl.write_section(bl.for_model("prefix-cache", args.model), text)


def verdict(ok: bool) -> str:
    return "met" if ok else "**NOT met**"


def ab_table(res: dict, goal: str) -> list[str]:
    """The on/off table of one part and its goal lines (two markdown blocks)."""
    table = ["| caching | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | hit rate | requests with no hit |"]
    table.append("|---|---:|---:|---:|---:|---:|")
    for n, v in ((n, res[n]) for n in ("on", "off")):
        table.append(
            f"| {n} | {v['ttft_p50_ms']:.1f} | {v['ttft_p99_ms']:.1f} | {v['tokens_per_s']:.0f} "
            f"| {100 * v['hit_rate']:.1f}% | {v['misses']:.0f} of {v['requests']:.0f} |"
        )
    tr, pr, rows = res["ttft_ratio"], res["throughput_ratio"], res["rounds"]
    ttft, tput = (" / ".join(f"{x:.2f}" for x in res[k]) for k in ("ttft_ratios", "throughput_ratios"))
    same_out = ", ".join(f"{x['same_outputs']} of {x['on']['requests']}" for x in rows)
    goals = [
        f"- TTFT p50, off / on: **{tr:.2f}x** (goal >= 5x{goal}): {verdict(tr >= 5)} (per round {ttft}).",
        f"- Throughput, on / off: **{pr:.2f}x** (goal >= 1.5x{goal}): {verdict(pr >= 1.5)} (per round {tput}).",
        f"- Greedy outputs equal with and without the cache: {same_out} requests (per round).",
    ]
    return ["\n".join(table), "\n".join(goals)]


def render(r: dict) -> str:
    model, argv = r.get("model"), " ".join(["", *r["argv"]])
    goal = " on the default model" if bl.is_default_model(model) else ""
    out = [
        "## Prefix caching and cache-aware routing" + ("" if goal else f" ({bl.model_label(model)})"),
        f"Command: `python bench/bench_prefix_cache.py{argv}` — {r['date']}, {r['machine']}",
        "Client -> gateway -> worker processes over gRPC on 127.0.0.1 (`GenerateStream`, token-id prompts cut from "
        f"held-out text, greedy, {NEW_TOKENS} new tokens, ignore_eos); workers with {r['threads']} torch thread(s), "
        f"`--max-model-len {ENGINE['max_model_len']} --num-kv-blocks {ENGINE['num_kv_blocks']}`. Every server stays "
        f"up for the whole run; in each of {r['rounds']} round(s) they run the same fresh prompts in turn (the "
        "order alternates), so no round finds another's cache. Figures are medians over the rounds, ratios the "
        "medians of the per-round ratios. TTFT: the client's, from sending a request to its first token delta. "
        "Hit rate: the requests' `Usage.cached_prompt_tokens` over their prompt tokens.",
    ]
    if "system" in r:
        out += [
            f"### Shared system prompt: {r['requests']} requests, {SYSTEM_TOKENS}-token system prompt + "
            f"{SUFFIX[0]}-{SUFFIX[1]}-token suffix, {r['clients']} closed-loop clients, one worker",
            "The first request runs alone (it computes the system prompt, on both servers), then the clients "
            "send the rest. Caching off: `--no-enable-prefix-caching`.",
            *ab_table(r["system"], goal),
        ]
    if "conversation" in r:
        out += [
            f"### {r['turns']}-turn conversations: {r['conversations']} at once, turn after turn, one worker",
            f"Turn 1 is a {FIRST_TURN}-token prompt; turn i is turn i-1's prompt + its answer + a new "
            f"{USER_LINE}-token user line.",
            *ab_table(r["conversation"], goal),
        ]
    if "routing" in r:
        ro, per = r["routing"], r["requests"] // r["prefixes"]
        out += [
            f"### Routing: {r['prefixes']} distinct {PREFIX_TOKENS}-token prefixes x {per} requests (each + its own "
            f"{ROUTE_SUFFIX}-token suffix), shuffled, {r['clients']} closed-loop clients",
            "Requests per worker come from the gateway's `draftwise_prefix_cache_queries_total{worker}` (each "
            "admission looks up its prompt less one token, and these prompts are all one length): the gateway has "
            "no per-worker request counter. The one-worker hit rate is the reference.",
        ]
        table = [
            "| routing | workers | hit rate | / one worker | requests per worker (last round) "
            "| largest / share (worst round) | routing decisions (last round) |",
            "|---|---:|---:|---:|---|---:|---|",
        ]
        for n, v in ((n, ro[n]) for n in ("prefix", "least-loaded", "one-worker")):
            last = ro["rounds"][-1][n]
            table.append(
                f"| {n} | {len(last['requests_per_worker'])} | {100 * v['hit_rate']:.1f}% "
                f"| {v.get('vs_one_worker', 1):.2f} | {' / '.join(f'{x:g}' for x in last['requests_per_worker'])} "
                f"| {v.get('worst_share', v['largest_share']):.2f} "
                f"| {', '.join(f'{a} {b}' for a, b in sorted(last['decisions'].items())) or '-'} |"
            )
        p, ll = ro["prefix"], ro["least-loaded"]
        counted = all(abs(x[n]["counted"] - r["requests"]) < 1e-6 for x in ro["rounds"] for n in x)
        goals = [
            f"- Prefix routing's hit rate / one worker's: **{p['vs_one_worker']:.2f}** (goal >= 0.90): "
            f"{verdict(p['vs_one_worker'] >= 0.9)}; least-loaded: {ll['vs_one_worker']:.2f}.",
            f"- Busiest worker's requests / its share under prefix routing (worst round): **{p['worst_share']:.2f}** "
            f"(goal <= 1.5): {verdict(p['worst_share'] <= 1.5)}; least-loaded: {ll['worst_share']:.2f}.",
            "- Requests per worker from the lookups: "
            + ("every request counted once." if counted else "**not** every request counted once (preemptions?)."),
        ]
        out += ["\n".join(table), "\n".join(goals)]
    if "speculation" in r:
        rows = r["speculation"]["rounds"]
        label = {"plain": "none", "ngram": "`--speculative-method ngram`", "draft": "`--speculative-model default`"}
        out.append("### Speculation: the shared-system-prompt workload on one worker with prefix caching")
        table = ["| speculation | hit rate (per round) | TTFT p50 (ms) | output tok/s | outputs equal to none's |"]
        table.append("|---|---|---:|---:|---|")
        for n in rows[0]:
            v = med([x[n] for x in rows])
            eq = " / ".join(str(x[n].get("same_outputs", "-")) for x in rows)
            hits = " / ".join(f"{100 * x[n]['hit_rate']:.2f}%" for x in rows)
            table.append(f"| {label[n]} | {hits} | {v['ttft_p50_ms']:.1f} | {v['tokens_per_s']:.0f} | {eq} |")
        ok = {n: all(x[n]["cached_tokens"] == x["plain"]["cached_tokens"] for x in rows) for n in list(rows[0])[1:]}
        goals = [f"- Hit rate with {label[n]} equal to none's, every round: {verdict(v)}." for n, v in ok.items()]
        out += ["\n".join(table), "\n".join(goals)]
    return "\n\n".join(out)


if __name__ == "__main__":
    main()
