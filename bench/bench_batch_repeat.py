"""The batch-64 workload of ``bench_engine.py`` (64 requests, prompts 16-512, outputs 16-256
tokens, greedy), draftwise alone, timed ``--repeats`` times after a warm-up: for A/B
comparisons of two checkouts in one session, where ``bench_engine.py``'s single timed run is
too noisy on a small machine.

    python bench/bench_batch_repeat.py [--model MODEL] [--repeats 3] [--threads 2] [--no-retain-freed-memory]

Prints one JSON line (commit, wall and process CPU seconds per run, their means); writes nothing.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, add_model_argument, heldout_prompts  # noqa: E402

from draftwise.worker import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--no-retain-freed-memory", action="store_true", help="keep glibc's malloc defaults (the engine's flag off)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype="float32", retain_freed_memory=not args.no_retain_freed_memory)
    n = 64
    prompts = heldout_prompts(llm.get_tokenizer(), n, (16, 512), seed=1)  # as bench_engine.bench_batch
    rng = random.Random(2)
    outs = [rng.randint(16, 256) for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    times, cpu = [], []
    for _ in range(args.repeats):
        t, c = time.perf_counter(), time.process_time()
        res = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        assert sum(len(r.outputs[0].token_ids) for r in res) == sum(outs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    out = {"commit": commit.stdout.strip(), "model": args.model or "embedded target"}
    out["retain_freed_memory"] = llm.engine.retains_freed_memory
    out.update(times_s=times, mean_s=statistics.mean(times))
    out.update(cpu_s=cpu, mean_cpu_s=statistics.mean(cpu))  # process CPU time: what a noisy VM's steal does not inflate
    print(json.dumps(out))


if __name__ == "__main__":
    main()
