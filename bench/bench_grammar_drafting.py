"""Structured output under speculation: does drafting under the grammar pay? (issue 27)

The draft model proposes for constrained requests either as it would unconstrained (its drafts
checked by the grammar, the refused ones rejected) or under the request's grammar (its logits
masked at each drafted position: ``Grammars.mask_draft``, what the engine does). Both are exact;
this measures what masking the draft changes: the share of drafts the grammar refuses, the
acceptance rate, the mean accepted length (tokens per verification, bonus included: the
hardware-independent figure) and wall time, against plain decoding of the same requests.

Workload: ``--requests`` generated JSON schemas (tests/engine/schema_gen.py, bounded, the suite's
generator) with one prompt, greedy and at temperature 0.8 (seeded), all submitted at once to one
in-process engine per configuration whose batch holds at most C of them (``--concurrency``: 1, one
request at a time; 40, all together), k = ``--k`` fixed.

    python bench/bench_grammar_drafting.py [--model MODEL] [--requests 40] [--concurrency 1,40] [--k 4]

The default model drafts with the embedded draft model; another ``--model`` needs
``--speculative-model``. Run it on a quiet machine: the wall-time ratios come from one run.
Results: docs/benchmarks.md (section ``grammar-drafting``) and bench/results/grammar_drafting.json.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from benchlib import MODEL_HELP, for_model, is_default_model, machine, model_label, save_results, write_section  # noqa: E402

from draftwise.logs import configure_logging  # noqa: E402
from draftwise.worker.core.config import EngineConfig  # noqa: E402
from draftwise.worker.engine.llm_engine import LLMEngine  # noqa: E402
from draftwise.worker.sampling.constraints import Constraint  # noqa: E402
from draftwise.worker.sampling.sampling_params import SamplingParams  # noqa: E402
from tests.engine.schema_gen import generate_schemas  # noqa: E402

PROMPT = "The answer, as JSON:"
QUIET_LOAD = 0.5


def run(cfg: dict[str, Any], schemas: list, temperature: float, max_tokens: int, masked: bool | None) -> dict:
    """One configuration: ``masked`` None = no speculation; False/True = draft model without/with drafting
    under the grammar."""
    engine = LLMEngine(EngineConfig(**cfg))
    if masked is False:
        assert engine.proposer is not None
        engine.proposer.draft_mask = None
    for i, s in enumerate(schemas):
        p = SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, constraint=Constraint.json_schema(s))
        engine.add_request(str(i), PROMPT, p)
    t0 = time.perf_counter()
    tokens = proposed = accepted = refused = rounds = 0
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            c = o.outputs[0]
            tokens += len(c.token_ids)
            if c.spec is not None:
                proposed, accepted = proposed + c.spec.proposed, accepted + c.spec.accepted
                refused, rounds = refused + c.spec.grammar_refused, rounds + c.spec.verify_steps
    seconds = time.perf_counter() - t0
    return {
        "masked_drafting": masked,
        "temperature": temperature,
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "proposed": proposed,
        "accepted": accepted,
        "grammar_refused": refused,
        "acceptance_rate": accepted / proposed if proposed else None,
        "refused_share": refused / proposed if proposed else None,
        "mean_accepted_length": 1 + accepted / rounds if rounds else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--speculative-model", default="default")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", default="1,40", help="the engine's max_num_seqs, one run per value")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-publish", action="store_true")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    if load > QUIET_LOAD:
        print(f"warning: load average {load:.2f}: the machine is busy, timings are not comparable", file=sys.stderr)
    torch.set_num_threads(args.threads)
    configure_logging("console", "warning")
    schemas = generate_schemas(args.requests, seed=5)
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        base: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": c}
        if not is_default_model(args.model):
            base["model"] = args.model
        spec = base | {
            "speculative_model": args.speculative_model,
            "num_speculative_tokens": args.k,
            "speculative_adaptive": False,
        }
        for temp in (0.0, 0.8):
            plain = run(base, schemas, temp, args.max_tokens, None) | {"concurrency": c}
            rows.append(plain)
            for masked in (False, True):
                r = run(spec, schemas, temp, args.max_tokens, masked) | {"concurrency": c}
                r["vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
                rows.append(r)
                print(r, flush=True)
    result = {
        "command": "python bench/bench_grammar_drafting.py " + shlex.join(sys.argv[1:]),
        "machine": machine(),
        "load_average": load,
        "rows": rows,
    }
    body = render(result, args)
    print(body)
    if not args.no_publish:
        save_results(for_model("grammar_drafting", args.model, "_"), result)
        write_section(for_model("grammar-drafting", args.model), body)


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None else f"{x:{fmt}}"


def render(r: dict, args: argparse.Namespace) -> str:
    lines = [
        f"## Structured output under speculation: drafting under the grammar ({model_label(args.model)}, float32, CPU)",
        "",
        f"Command: `{r['command']}` — {time.strftime('%Y-%m-%d')}, {r['machine']}, load average {r['load_average']:.2f}",
        "",
        f"{args.requests} generated JSON schemas (tests/engine/schema_gen.py, seed 5), one prompt, at most"
        f" {args.max_tokens} tokens, all at once in one in-process engine whose batch holds at most C (1: one at a"
        f" time); draft model at k = {args.k} fixed (no adaptive policy, which would turn drafting off where it"
        " does not pay)."
        " `unmasked`: the draft proposes as it would unconstrained and the grammar refuses what it forbids;"
        " `masked`: the draft's logits are masked by the request's grammar at each drafted position (the"
        " engine's behaviour). Both exact; tok/s against plain decoding of the same requests, same run.",
        "",
        "| C | temperature | drafting | output tok/s | vs plain | drafts refused by the grammar | acceptance |"
        " mean accepted length |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for x in r["rows"]:
        mode = {None: "plain (no speculation)", False: "unmasked", True: "masked"}[x["masked_drafting"]]
        lines.append(
            f"| {x['concurrency']} | {x['temperature']} | {mode} | {x['tokens_per_s']:.1f} | {_f(x.get('vs_plain'), '.2f')}"
            f"{'x' if x.get('vs_plain') else ''} | {_f(x['refused_share'], '.1%')} | {_f(x['acceptance_rate'], '.1%')}"
            f" | {_f(x['mean_accepted_length'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
