"""The suffix proposer (``speculative_method="suffix"``) against plain decoding and n-gram lookup
(and, with ``--methods``, a draft model or Medusa heads alone and with the suffix cache beside them),
in-process, greedy, float32 on CPU; every ratio from measurements of the same run.

Two workloads of token-id prompts cut from held-out text (files the embedded models never
trained on; ``benchlib.heldout_prompts``):

- ``agent``: what an agent loop sends: 8 snippets (48-96 tokens), each asked about again and
  again (48 requests, each a snippet after a distinct 8-32-token preamble of its own, in a
  fixed shuffled order): later answers repeat earlier ones, which only a cache across requests
  can draft (prompt lookup sees one request);
- ``novel``: 48 distinct prompts (48-96 tokens): nothing to find but the request's own tokens,
  where the suffix proposer must cost nothing (goal: >= 0.95x plain).

For each workload and concurrency C (closed loop: C requests in the engine, the next added when
one finishes) every method runs ``--repeats`` times in turned order, each keeping its fastest
run; the suffix cache is emptied before every run, so each run starts cold and fills as it goes.
Reported: output tokens/s, the ratio against plain, mean accepted length, acceptance rate.

    python bench/bench_suffix.py [--model MODEL] [--concurrency 1,16] [--max-tokens 64] [--repeats 2] [--threads 2]
        [--methods plain,ngram,suffix,draft,draft+suffix]   # medusa(+suffix), eagle(+suffix): the head shipped for --model

Results: docs/benchmarks.md (section ``suffix``, or ``suffix-<model>``) and bench/results/suffix[_<model>].json.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import random
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_heads import accept_stats, closed_loop  # noqa: E402
from benchlib import (  # noqa: E402
    MODEL_HELP,
    heldout_prompts,
    is_default_model,
    machine,
    model_slug,
    save_results,
    write_section,
)

from draftwise.logs import configure_logging  # noqa: E402
from draftwise.worker import LLM, SamplingParams  # noqa: E402
from draftwise.worker.speculative.hybrid import HybridProposer  # noqa: E402
from draftwise.worker.speculative.suffix import SuffixCache, SuffixProposer  # noqa: E402

ALL_METHODS = {
    "plain": {},
    "ngram": {"speculative_method": "ngram"},
    "suffix": {"speculative_method": "suffix"},
    "draft": {"speculative_model": "default"},  # the embedded draft: the default model only
    "draft+suffix": {"speculative_model": "default", "speculative_lookup": "suffix"},
    "medusa": {"speculative_method": "medusa"},  # the head shipped for the target
    "medusa+suffix": {"speculative_method": "medusa", "speculative_lookup": "suffix"},
    "eagle": {"speculative_method": "eagle"},  # the head shipped for the target
    "eagle+suffix": {"speculative_method": "eagle", "speculative_lookup": "suffix"},
}


def workloads(llm: LLM, n: int, seed: int) -> dict[str, list[dict]]:
    tok = llm.engine.tokenizer
    rng = random.Random(seed)
    snippets = heldout_prompts(tok, 8, (48, 96), seed)
    preambles = heldout_prompts(tok, n, (8, 32), seed + 1)
    agent = [{"ids": pre + rng.choice(snippets)[1:], "stops": ()} for pre in preambles]
    novel = [{"ids": ids, "stops": ()} for ids in heldout_prompts(tok, n, (48, 96), seed + 2)]
    return {"agent": agent, "novel": novel}


def run(llm: LLM, prompts: list[dict], concurrency: int, max_tokens: int) -> tuple[float, list]:
    spec = llm.engine.spec
    for part in () if spec is None else spec.proposer.parts:
        if isinstance(part, SuffixProposer):
            part.cache = SuffixCache(part.cache.max_tokens)
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]
    seconds, outs = closed_loop(llm, list(enumerate(prompts)), params, concurrency)
    return seconds, [o for _, o in outs]


def lookup_rounds(llm: LLM) -> list[int] | None:
    """A hybrid's verified rounds so far, drafted by (its model, its lookup); None for the others."""
    spec = llm.engine.spec
    proposer = None if spec is None else spec.proposer
    return list(proposer.drafted) if isinstance(proposer, HybridProposer) else None


def _share(before: list[int] | None, after: list[int]) -> float:
    model, lookup = (a - b for a, b in zip(after, before or [0, 0], strict=True))
    return lookup / max(1, model + lookup)


def lookup_cost(requests: int = 128, context: int = 32_768, steps: int = 20) -> dict:
    """Host time of one step's lookups for ``requests`` requests of ``context`` tokens each (no
    model): the suffix proposer (its own index kept incrementally; the first lookup of a request
    indexes it whole, timed apart) against n-gram prompt lookup, which scans the context."""
    from draftwise.worker.core.request import Request
    from draftwise.worker.speculative.ngram import NgramProposer
    from draftwise.worker.speculative.suffix import SuffixProposer

    rng = random.Random(0)
    reqs = []
    for i in range(requests):
        r = Request(f"c{i}", None, [rng.randrange(8192) for _ in range(context)], SamplingParams(), 64)
        reqs.append(r)
    suffix, ngram = SuffixProposer(), NgramProposer(1, 4)
    t = time.perf_counter()
    for r in reqs:
        suffix.plan(r, 5)
    first = time.perf_counter() - t
    s_times, n_times = [], []
    for _ in range(steps):
        for r in reqs:
            r.output_token_ids.append(rng.randrange(8192))
        t = time.perf_counter()
        for r in reqs:
            suffix.plan(r, 5)
        s_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        for r in reqs:
            ngram.plan(r, 5)
        n_times.append(time.perf_counter() - t)
    s_ms, n_ms = 1e3 * sorted(s_times)[steps // 2], 1e3 * sorted(n_times)[steps // 2]
    return {
        "requests": requests,
        "context": context,
        "suffix_ms": s_ms,
        "ngram_ms": n_ms,
        "suffix_first_ms": 1e3 * first,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="plain,ngram,suffix", help=f"of {', '.join(ALL_METHODS)}; plain always runs")
    ap.add_argument("--no-publish", action="store_true")
    args = ap.parse_args()
    methods = {m: ALL_METHODS[m] for m in ["plain", *args.methods.split(",")]}
    torch.set_num_threads(args.threads)
    configure_logging("console", "warning")
    levels = [int(c) for c in args.concurrency.split(",")]
    base = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": max(levels), "num_kv_blocks": 2048}
    if args.model and not is_default_model(args.model):
        base["model"] = args.model
    llms = {m: LLM(**base, **spec) for m, spec in methods.items()}
    loads = workloads(llms["plain"], args.requests, 7)
    for llm in llms.values():  # warm up (first calls allocate and compile)
        run(llm, loads["novel"][:4], 2, 8)
    rows = []
    for name, prompts in loads.items():
        for c in levels:
            best: dict[str, tuple[float, list]] = {}
            shares: dict[str, float | None] = {}  # a hybrid's rounds the lookup drafted, in its best run
            order = list(methods)
            for r in range(args.repeats):
                for m in order[r % len(order) :] + order[: r % len(order)]:
                    before = lookup_rounds(llms[m])
                    s, outs = run(llms[m], prompts, c, args.max_tokens)
                    after = lookup_rounds(llms[m])
                    if m not in best or s < best[m][0]:
                        best[m] = (s, outs)
                        shares[m] = None if after is None else _share(before, after)
            ref_tokens = [o.outputs[0].token_ids for o in best["plain"][1]]
            plain_tps = sum(len(t) for t in ref_tokens) / best["plain"][0]
            for m, (s, outs) in best.items():
                st = accept_stats(outs)
                same = sum(o.outputs[0].token_ids == t for o, t in zip(outs, ref_tokens, strict=True))
                tps = st["output_tokens"] / s
                rows.append(
                    {"workload": name, "concurrency": c, "method": m, "tokens_per_s": tps, "ratio": tps / plain_tps}
                    | {k: st[k] for k in ("mean_accepted_length", "acceptance_rate")}
                    | {"equal_to_plain": f"{same}/{len(outs)}", "lookup_share": shares.get(m)}
                )
                print(rows[-1], flush=True)
    cost = lookup_cost()
    print(cost, flush=True)
    result = {
        "command": "python bench/bench_suffix.py " + shlex.join(sys.argv[1:]),
        "machine": machine(),
        "rows": rows,
        "lookup_cost": cost,
    }
    body = render(result, args)
    print(body)
    if not args.no_publish:
        slug = model_slug(args.model)
        section = "suffix" if set(methods) <= {"plain", "ngram", "suffix"} else "hybrid"  # its own section
        save_results(section + (f"_{slug}" if slug else ""), result)
        write_section(section + (f"-{slug}" if slug else ""), body)


def render(r: dict, args: argparse.Namespace) -> str:
    lines = [
        '## Suffix decoding (speculative_method="suffix")'
        + (
            ""
            if all(x["method"] in ("plain", "ngram", "suffix") for x in r["rows"])
            else ", and beside a model drafter"
        ),
        "",
        f"Command: `{r['command']}` — {time.strftime('%Y-%m-%d')}, {r['machine']}",
        "",
        f"In-process `LLM`, greedy, {args.max_tokens} new tokens, {args.requests} requests per workload, closed loop;"
        f" each method's fastest of {args.repeats} runs in turned order, the suffix cache emptied before each run."
        " `agent`: 8 held-out snippets asked about again and again behind distinct preambles (later answers repeat"
        " earlier ones); `novel`: distinct held-out prompts (nothing to find across requests). See bench/bench_suffix.py.",
        "",
        "| workload | concurrency | method | output tok/s | vs plain | mean accepted length | acceptance |"
        " outputs equal to plain | hybrid: rounds the lookup drafted |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for x in r["rows"]:
        share = x.get("lookup_share")
        lines.append(
            f"| {x['workload']} | {x['concurrency']} | {x['method']} | {x['tokens_per_s']:.1f} | {x['ratio']:.2f}x |"
            f" {x['mean_accepted_length']:.2f} | {x['acceptance_rate']:.2f} | {x['equal_to_plain']} |"
            f" {'' if share is None else f'{share:.0%}'} |"
        )
    c = r["lookup_cost"]
    lines += [
        "",
        f"Host cost of one step's lookups, {c['requests']} requests of {c['context']} tokens (no model, median of 20"
        f" steps): suffix **{c['suffix_ms']:.2f} ms**, n-gram prompt lookup {c['ngram_ms']:.1f} ms"
        f" ({c['ngram_ms'] / c['suffix_ms']:.0f}x); the suffix proposer's first lookup of those requests (indexing"
        f" their contexts whole, once): {c['suffix_first_ms']:.0f} ms.",
    ]
    goals = {(x["workload"], x["concurrency"]): x["ratio"] for x in r["rows"] if x["method"] == "suffix"}
    lines.append("")
    for (w, c), ratio in sorted(goals.items()):
        goal = 0.95 if w == "novel" else (2.0 if c == 1 else 1.3)
        verdict = "met" if ratio >= goal else "**NOT met**"
        lines.append(f"- suffix, {w}, concurrency {c}: {ratio:.2f}x plain (goal >= {goal}x): {verdict}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
