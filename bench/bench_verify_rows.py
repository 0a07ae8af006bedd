"""What a verify pass over more rows costs: one sequence's target forward over ``q`` new tokens
(1 = a plain decode step; 1 + k = a chain of k drafts; 1 + N = a tree of N drafted nodes) at a
context of ``--context`` tokens, batch 1, as a ratio against ``q = 1`` measured in the same run.
This is the price side of speculating wider: a tree of N nodes pays only where its accepted
length grows faster than this ratio (``scripts/tree_acceptance.py`` gives the other side).

Rows alternate over ``--rounds`` rounds; each keeps the fastest round's median step.

    python bench/bench_verify_rows.py --model smollm2-135m-instruct [--context 200] [--rows 1,2,3,5,7,9,13,17,25,33]

Writes docs/benchmarks.md (section ``verify-rows`` + the model) and bench/results/verify_rows*.json.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import add_model_argument, for_model, machine, model_label, save_results, write_section  # noqa: E402

from draftwise.worker.model.kv_cache import KVCache  # noqa: E402
from draftwise.worker.model.loader import load_model  # noqa: E402
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk  # noqa: E402
from draftwise.worker.paths import resolve_model  # noqa: E402


def measure(model: str | None, context: int, rows: list[int], steps: int, rounds: int) -> dict[int, float]:
    """Milliseconds of a batch-1 forward over each row count at ``context`` (fastest round's median)."""
    loaded = load_model(resolve_model(model), dtype="float32")
    per_seq = -(-(context + max(rows) + 16) // 16)
    runner = ModelRunner(loaded, KVCache(loaded.config, per_seq, 16, torch.float32, "cpu"))
    table = list(range(per_seq))
    runner.run([SequenceChunk([1] + [5 + i % 100 for i in range(context - 1)], 0, table)])
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(rounds):
        for q in rows:
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                runner.run([SequenceChunk([7 + j for j in range(q)], context, table)])  # overwrites the same slots
                times.append(time.perf_counter() - t)
            best[q] = min(best[q], 1000 * statistics.median(times[steps // 5 :]))
    return best


def render(r: dict) -> str:
    base = r["ms"]["1"]
    lines = [
        f"## Verify cost by rows ({model_label(r['model'])}, float32, CPU, batch 1, context {r['context']})",
        "",
        f"`{r['command']}` — {r['machine']}, {r['date']}.",
        "",
        "| rows (1 + drafted tokens) | ms per forward | x one row |",
        "|---:|---:|---:|",
    ]
    for q, ms in r["ms"].items():
        lines.append(f"| {q} | {ms:.2f} | {ms / base:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(ap)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rows", default="1,2,3,5,7,9,13,17,25,33")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--print-only", action="store_true", help="print the table; write neither docs nor results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = sorted({int(v) for v in args.rows.split(",")} | {1})
    ms = measure(args.model, args.context, rows, args.steps, args.rounds)
    r = {
        "command": "python bench/bench_verify_rows.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "context": args.context,
        "ms": {str(q): v for q, v in ms.items()},
    }
    if not args.print_only:
        save_results(for_model("verify_rows", args.model, "_"), r)
        write_section(for_model("verify-rows", args.model), render(r))
    print(render(r))
    print(json.dumps(r["ms"]))


if __name__ == "__main__":
    main()
