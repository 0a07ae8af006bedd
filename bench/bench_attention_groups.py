"""What a batch-16 forward costs when a few of its sequences bring more than one new token (a
verify round, a prompt's last short chunk), with the torch attention's short sequences grouped
by new-token count (``SHORT_GROUP_BOUNDS``, what the engine runs) against one padded group for
all of them (what it ran before: every decode row padded to the longest row's length), in the
same run. The reference for each composition is the grouped forward; a second column prices it
against a decode-only step.

Sixteen sequences at contexts of 100-200 tokens; the compositions alternate over ``--rounds``
rounds, each keeping its fastest round's median of ``--steps`` forwards.

    python bench/bench_attention_groups.py --model smollm2-135m-instruct [--rounds 3] [--steps 15]

Writes docs/benchmarks.md (section ``attention-groups`` + the model) and
bench/results/attention_groups*.json.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import add_model_argument, for_model, machine, model_label, save_results, write_section  # noqa: E402

from draftwise.kernels import reference  # noqa: E402
from draftwise.worker.model.chunk import SequenceChunk  # noqa: E402
from draftwise.worker.model.kv_cache import KVCache  # noqa: E402
from draftwise.worker.model.loader import load_model  # noqa: E402
from draftwise.worker.model.model_runner import ModelRunner  # noqa: E402
from draftwise.worker.paths import resolve_model  # noqa: E402

BATCH = 16
# name -> new tokens per sequence
COMPOSITIONS = {
    "16 decode": [1] * BATCH,
    "15 decode + 1 verify of 4 drafts": [1] * 15 + [5],
    "12 decode + 4 verify of 4 drafts": [1] * 12 + [5] * 4,
    "15 decode + 1 verify of 8 drafts": [1] * 15 + [9],
    "16 verify of 4 drafts": [5] * BATCH,
    "15 decode + 1 prompt chunk of 32": [1] * 15 + [32],
}
ONE_GROUP = (reference.SHORT_QUERY_MAX,)  # the layout before: one padded group for every short sequence


def measure(model: str | None, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """Milliseconds per forward of each composition, grouped and as one group."""
    loaded = load_model(resolve_model(model), dtype="float32")
    rng = random.Random(0)
    contexts = [rng.randint(100, 200) for _ in range(BATCH)]
    per_seq = -(-(max(contexts) + 48) // 16)
    runner = ModelRunner(loaded, KVCache(loaded.config, per_seq * BATCH, 16, torch.float32, "cpu"))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(BATCH)]
    for c, t in zip(contexts, tables, strict=True):
        runner.run([SequenceChunk([1] + [5 + i % 100 for i in range(c - 1)], 0, t)])
    grouped = reference.SHORT_GROUP_BOUNDS
    best: dict[str, dict[str, float]] = {
        name: {"grouped": float("inf"), "one group": float("inf")} for name in COMPOSITIONS
    }
    for _ in range(rounds):
        for name, lens in COMPOSITIONS.items():
            chunks = [
                SequenceChunk([7 + j for j in range(q)], c, t, num_logits=q if q <= 9 else 1)
                for q, c, t in zip(lens, contexts, tables, strict=True)
            ]  # a verify round wants every row's logits, a prompt chunk its last; the same slots every time
            for layout, bounds in (("grouped", grouped), ("one group", ONE_GROUP)):
                reference.SHORT_GROUP_BOUNDS = bounds
                try:
                    times = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        runner.run(chunks)
                        times.append(time.perf_counter() - t0)
                finally:
                    reference.SHORT_GROUP_BOUNDS = grouped
                best[name][layout] = min(best[name][layout], 1000 * statistics.median(times[steps // 5 :]))
    return best


def render(r: dict) -> str:
    decode = r["ms"]["16 decode"]["grouped"]
    lines = [
        f"## Attention groups ({model_label(r['model'])}, float32, CPU, batch 16, contexts 100-200)",
        "",
        f"`{r['command']}` — {r['machine']}, {r['date']}.",
        "",
        "One forward of 16 sequences; the torch attention either groups short sequences by new-token count "
        "(1, <= 4, <= 8, <= 16, <= 32; the engine's layout) or pads them all to the longest (one group: before). "
        "Fastest round's median; see bench/bench_attention_groups.py.",
        "",
        "| composition | grouped (ms) | one group (ms) | one group / grouped | grouped / 16 decode |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, ms in r["ms"].items():
        g, o = ms["grouped"], ms["one group"]
        lines.append(f"| {name} | {g:.2f} | {o:.2f} | **{o / g:.2f}x** | {g / decode:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(ap)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--print-only", action="store_true", help="print the table; write neither docs nor results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    r = {
        "command": "python bench/bench_attention_groups.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "ms": measure(args.model, args.steps, args.rounds),
    }
    if not args.print_only:
        save_results(for_model("attention_groups", args.model, "_"), r)
        write_section(for_model("attention-groups", args.model), render(r))
    print(render(r))
    print(json.dumps(r["ms"]))


if __name__ == "__main__":
    main()
