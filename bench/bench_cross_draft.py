"""A draft model with another tokenizer (TLI and SLEM, docs/engine.md "Drafts with another
tokenizer") against plain decoding, in-process, greedy, on CPU; every ratio from measurements of
the same run.

The pair: the target ``--model`` (default SmolLM2-135M-Instruct, a 49k-token vocabulary) and the
draft ``--draft`` (default: the embedded 3M code draft, an 8k-token vocabulary); the prompts are
windows of held-out code (bench/benchlib.py), as the issue asks ("on code prompts"). Methods:
plain; TLI and SLEM with k fixed (every step drafts, so acceptance is measured on every
position); TLI with the speculation policy (what a user gets: it drafts only while drafting pays).

For each concurrency C (closed loop) every method runs ``--repeats`` times in turned order, each
keeping its fastest run. Reported: output tokens/s, the ratio against plain, acceptance (accepted
over drafted), mean accepted length (tokens per verify pass, bonus included), and the
intersection the worker logged at load.

    python bench/bench_cross_draft.py [--model smollm2-135m-instruct] [--draft default] [--concurrency 1,4]

Results: docs/benchmarks.md (section ``cross-draft-<model>``) and bench/results/cross_draft_<model>.json.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_heads import accept_stats, closed_loop, fastest_runs  # noqa: E402
from benchlib import MODEL_HELP, heldout_prompts, machine, model_slug, save_results, write_section  # noqa: E402

from draftwise.logs import configure_logging  # noqa: E402
from draftwise.worker import LLM, SamplingParams  # noqa: E402
from draftwise.worker.paths import resolve_model  # noqa: E402
from draftwise.worker.speculative.cross_draft import CrossVocabProposer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help=MODEL_HELP)
    ap.add_argument("--draft", default="default", help="the draft checkpoint (default: the embedded draft)")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="tokens drafted every step in the fixed-k rows")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-publish", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configure_logging("console", "warning")
    levels = [int(c) for c in args.concurrency.split(",")]
    base: dict = {"model": str(resolve_model(args.model)), "dtype": "float32", "max_model_len": 1024}
    base.update(max_num_seqs=max(levels), num_kv_blocks=1024)
    fixed = {"num_speculative_tokens": args.k, "speculative_adaptive": False}
    methods = {
        "plain": {},
        f"TLI, k = {args.k}": {"speculative_model": args.draft, "speculative_vocab_mapping": "tli", **fixed},
        f"SLEM, k = {args.k}": {"speculative_model": args.draft, "speculative_vocab_mapping": "slem", **fixed},
        "TLI, policy": {"speculative_model": args.draft, "speculative_vocab_mapping": "tli"},
    }
    llms = {m: LLM(**base, **spec) for m, spec in methods.items()}
    proposer = llms[f"TLI, k = {args.k}"].engine.spec.proposer  # type: ignore[union-attr]
    if not isinstance(proposer, CrossVocabProposer):
        raise SystemExit(f"{args.draft} shares {args.model}'s tokenizer: nothing to bridge")
    bridge = proposer.bridge
    overlap = {
        "shared_tokens": bridge.shared,
        "draft_tokens": len(bridge.draft_surfaces),
        "target_tokens": len(bridge.target_surfaces),
        "overlap_of_draft": bridge.overlap,
    }
    prompts = [
        {"ids": ids, "stops": ()}
        for ids in heldout_prompts(llms["plain"].engine.tokenizer, args.requests, (32, 96), seed=11)
    ]
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True) for _ in prompts]
    for llm in llms.values():  # warm-up
        closed_loop(llm, list(enumerate(prompts[:2])), params[:2], 2)
    rows = []
    for c in levels:
        best = fastest_runs(llms, prompts, params, c, args.repeats)
        ref = [o.outputs[0].token_ids for o in best["plain"][1]]
        plain_tps = sum(len(t) for t in ref) / best["plain"][0]
        for m, (s, outs) in best.items():
            st = accept_stats(outs)
            rows.append(
                {
                    "concurrency": c,
                    "method": m,
                    "tokens_per_s": st["output_tokens"] / s,
                    "ratio": st["output_tokens"] / s / plain_tps,
                    "acceptance_rate": st["acceptance_rate"],
                    "drafted": st["proposed"],
                    "mean_accepted_length": st["mean_accepted_length"],
                    "equal_to_plain": f"{sum(o.outputs[0].token_ids == t for o, t in zip(outs, ref, strict=True))}/{len(outs)}",
                }
            )
            print(rows[-1], flush=True)
    result = {
        "command": "python bench/bench_cross_draft.py " + shlex.join(sys.argv[1:]),
        "machine": machine(),
        "pair": f"{args.model} drafted for by {args.draft}",
        "overlap": overlap,
        "rows": rows,
    }
    body = render(result, args)
    print(body)
    if not args.no_publish:
        slug = model_slug(args.model) or "default"
        save_results(f"cross_draft_{slug}", result)
        write_section(f"cross-draft-{slug}", body)


def render(r: dict, args: argparse.Namespace) -> str:
    o = r["overlap"]
    lines = [
        "## A draft with another tokenizer (TLI and SLEM)",
        "",
        f"Command: `{r['command']}` — {time.strftime('%Y-%m-%d')}, {r['machine']}",
        "",
        f"Pair: {r['pair']}. Intersection: {o['shared_tokens']} tokens, {o['overlap_of_draft']:.1%} of the draft's"
        f" {o['draft_tokens']}, {o['shared_tokens'] / o['target_tokens']:.1%} of the target's {o['target_tokens']}."
        f" In-process `LLM`, float32, greedy, {args.max_tokens} new tokens, {args.requests} held-out code prompts,"
        f" closed loop; each method's fastest of {args.repeats} runs in turned order. See bench/bench_cross_draft.py.",
        "",
        "| concurrency | method | output tok/s | vs plain | acceptance | mean accepted length | outputs equal to plain |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for x in r["rows"]:
        lines.append(
            f"| {x['concurrency']} | {x['method']} | {x['tokens_per_s']:.1f} | {x['ratio']:.2f}x |"
            f" {x['acceptance_rate']:.3f} | {x['mean_accepted_length']:.2f} | {x['equal_to_plain']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
