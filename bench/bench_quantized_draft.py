"""A float16, int8 or int4 draft beside a float32 target (``speculative_quantization="fp16"`` /
``"int8"`` / ``"int4"``: weight-only codes, a scale and minimum per 32 inputs) against the same draft in float32 and against plain
decoding, in-process, greedy, on CPU; every ratio from measurements of the same run.

The pair: the embedded target and its draft for the default model; for another model (``--model``)
the model itself as its own draft (self-speculation: in float32 it would accept everything and
save nothing, so only the float16, int8 and int4 copies, about a half, a quarter and a sixth of the
bytes per draft step, are worth running: the float32 row shows what drafting costs when the draft costs a target step).

For each concurrency C (closed loop) every method runs ``--repeats`` times in turned order, each
keeping its fastest run. Reported: output tokens/s, the ratio against plain, acceptance (accepted
over drafted), mean accepted length, and the draft step: the fastest recent draft step of one
request, as the engine's speculation policy measured it (``CostModel.draft_time(1)``).

    python bench/bench_quantized_draft.py [--model MODEL] [--concurrency 1,4] [--requests 16] [--max-tokens 64] [--k 4]

Results: docs/benchmarks.md (section ``quantized-draft``, or ``quantized-draft-<model>``) and
bench/results/quantized_draft[_<model>].json.
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
from benchlib import MODEL_HELP, heldout_prompts, is_default_model, machine, model_slug, save_results, write_section  # noqa: E402

from draftwise.logs import configure_logging  # noqa: E402
from draftwise.worker import LLM, SamplingParams  # noqa: E402
from draftwise.worker.paths import resolve_model  # noqa: E402

GOAL_STEP = 1.5  # issue: the quantized draft's step at least 1.5x cheaper
GOAL_ACCEPTANCE = 0.02  # and its acceptance within 0.02 of the float draft's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--k", type=int, default=4, help="tokens drafted every step (fixed: the policy would pick k by cost)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-publish", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configure_logging("console", "warning")
    levels = [int(c) for c in args.concurrency.split(",")]
    default = not args.model or is_default_model(args.model)
    base: dict = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": max(levels), "num_kv_blocks": 1024}
    base["quantization"] = "none"  # a float32 target (the default keeps a GGUF file's exact codes)
    if not default:
        base["model"] = str(resolve_model(args.model))
    draft = "default" if default else base["model"]
    fixed = {"num_speculative_tokens": args.k, "speculative_adaptive": False}  # acceptance compared like with like
    methods = {
        "plain": {},
        "draft float32": {"speculative_model": draft, **fixed},
        "draft fp16": {"speculative_model": draft, "speculative_quantization": "fp16", **fixed},
        "draft int8": {"speculative_model": draft, "speculative_quantization": "int8", **fixed},
        "draft int4": {"speculative_model": draft, "speculative_quantization": "int4", **fixed},
    }
    llms = {m: LLM(**base, **spec) for m, spec in methods.items()}
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
            spec = llms[m].engine.spec
            step = None if spec is None else spec.policy.costs.draft_time(1)
            rows.append(
                {
                    "concurrency": c,
                    "method": m,
                    "tokens_per_s": st["output_tokens"] / s,
                    "ratio": st["output_tokens"] / s / plain_tps,
                    "acceptance_rate": st["acceptance_rate"],
                    "drafted": st["proposed"],
                    "mean_accepted_length": st["mean_accepted_length"],
                    "draft_step_ms": None if step is None else 1e3 * step,
                    "equal_to_plain": f"{sum(o.outputs[0].token_ids == t for o, t in zip(outs, ref, strict=True))}/{len(outs)}",
                }
            )
            print(rows[-1], flush=True)
    result = {
        "command": "python bench/bench_quantized_draft.py " + shlex.join(sys.argv[1:]),
        "machine": machine(),
        "pair": "the embedded target and draft" if default else f"{args.model} drafting for itself",
        "rows": rows,
    }
    body = render(result, args)
    print(body)
    if not args.no_publish:
        slug = model_slug(args.model)
        save_results("quantized_draft" + (f"_{slug}" if slug else ""), result)
        write_section("quantized-draft" + (f"-{slug}" if slug else ""), body)


def render(r: dict, args: argparse.Namespace) -> str:
    lines = [
        '## A float16, int8 or int4 draft beside a float32 target (speculative_quantization="fp16" / "int8" / "int4")',
        "",
        f"Command: `{r['command']}` — {time.strftime('%Y-%m-%d')}, {r['machine']}",
        "",
        f"Pair: {r['pair']}. In-process `LLM`, float32 target, greedy, {args.max_tokens} new tokens, {args.requests}"
        f" held-out prompts, closed loop, k = {args.k} drafted every step (fixed, so that the two drafts' acceptance"
        f" compares like with like); each method's fastest of {args.repeats} runs in turned order. Draft step:"
        " the fastest recent draft step of one request, as the speculation policy measured it. See"
        " bench/bench_quantized_draft.py.",
        "",
        "| concurrency | method | output tok/s | vs plain | acceptance | mean accepted length | draft step (ms) |"
        " outputs equal to plain |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for x in r["rows"]:
        step = "" if x["draft_step_ms"] is None else f"{x['draft_step_ms']:.2f}"
        lines.append(
            f"| {x['concurrency']} | {x['method']} | {x['tokens_per_s']:.1f} | {x['ratio']:.2f}x |"
            f" {x['acceptance_rate']:.3f} | {x['mean_accepted_length']:.2f} | {step} | {x['equal_to_plain']} |"
        )
    lines.append("")
    for c in sorted({x["concurrency"] for x in r["rows"]}):
        by = {x["method"]: x for x in r["rows"] if x["concurrency"] == c}
        f32 = by["draft float32"]
        for mode in ("fp16", "int8", "int4"):
            q = by.get(f"draft {mode}")
            if q is None:
                continue
            if f32["draft_step_ms"] and q["draft_step_ms"]:
                cheaper = f32["draft_step_ms"] / q["draft_step_ms"]
                verdict = "met" if cheaper >= GOAL_STEP else "**NOT met**"
                lines.append(
                    f"- concurrency {c}: the {mode} draft step is {cheaper:.2f}x cheaper (goal >= {GOAL_STEP}x): {verdict}."
                )
            delta = abs(q["acceptance_rate"] - f32["acceptance_rate"])
            verdict = "met" if delta <= GOAL_ACCEPTANCE else "**NOT met**"
            if not q.get("drafted", 1) or not f32.get("drafted", 1):
                verdict = "not compared (the policy drafted nothing in one of the runs)"
            lines.append(
                f"- concurrency {c}: {mode} acceptance {q['acceptance_rate']:.3f} against {f32['acceptance_rate']:.3f} (goal:"
                f" within {GOAL_ACCEPTANCE}): {verdict}; end to end {q['ratio']:.2f}x plain (float32 draft {f32['ratio']:.2f}x)."
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
