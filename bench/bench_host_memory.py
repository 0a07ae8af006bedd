"""Decode steps at batch 64 with the worker keeping freed host memory and with glibc's
defaults (``EngineConfig.retain_freed_memory``), each in processes of its own (the setting
is process-wide), alternating: per-step time and page faults.

64 requests decode at contexts of 200 to 600 tokens on the embedded default target (or
``--model``); each process times 120 ``engine.step()`` calls after the prompts are in.

    python bench/bench_host_memory.py [--model MODEL] [--rounds 2] [--threads 2]

Writes docs/benchmarks.md (section ``host-memory``) and bench/results/host_memory.json; with
another ``--model``, section ``host-memory-<model>`` and host_memory_<model>.json.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    add_model_argument,
    for_model,
    is_default_model,
    machine,
    model_label,
    save_results,
    write_section,
)

CHILD = """
import json, resource, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.sampling.sampling_params import SamplingParams
# another model: room for all 64 sequences (the default 1 GiB budget holds fewer of a larger model's tokens)
room = {"num_kv_blocks": 64 * 1024 // 16} if sys.argv[3] else {}
eng = LLMEngine(EngineConfig(model=sys.argv[3] or None, dtype="float32", max_num_seqs=64, max_model_len=1024, skip_tokenizer_init=True,
                             retain_freed_memory=sys.argv[1] == "on", **room))
v = eng.loaded.config.vocab_size
for i in range(64):
    prompt = [1] + [(7 * i + 13 * j) % (v - 3) + 3 for j in range(200 + 3 * i)]
    eng.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or eng.scheduler.waiting:
    eng.step()
for _ in range(5):
    eng.step()
ts = []
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(120):
    t = time.perf_counter()
    out = eng.step()
    ts.append(time.perf_counter() - t)
    assert out.stats.num_scheduled == 64
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print(json.dumps({"on": eng.retains_freed_memory, "step_ms": [1000 * t for t in ts], "faults_per_step": faults / 120}))
"""


def run(mode: str, threads: int, model: str | None = None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.pop(k, None)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(threads), model or ""],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(ap)
    ap.add_argument("--rounds", type=int, default=2, help="processes per setting (alternating)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    runs: list[dict] = []
    for i in range(args.rounds):
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            r = run(mode, args.threads, args.model)
            runs.append(r)
            print(f"{mode}: median {statistics.median(r['step_ms']):.1f} ms, {r['faults_per_step']:.0f} faults/step")
    rows = []
    for on in (True, False):
        mine = [r for r in runs if r["on"] is on]
        med = [statistics.median(r["step_ms"]) for r in mine]
        faults = [r["faults_per_step"] for r in mine]
        rows.append((on, med, faults))
    flag = "" if is_default_model(args.model) else f" --model {args.model}"
    on_med = statistics.mean(rows[0][1])
    off_med = statistics.mean(rows[1][1])
    body = [
        f"## Freed host memory kept (batch-64 decode step, {model_label(args.model)}, float32, CPU)",
        "",
        f"Command: `python bench/bench_host_memory.py --rounds {args.rounds}{flag}` — {machine()}",
        "",
        "| setting | median step per process (ms) | page faults per step |",
        "| --- | --- | --- |",
    ]
    for on, med, faults in rows:
        label = "kept (`retain_freed_memory`, default)" if on else "glibc's defaults (`--no-retain-freed-memory`)"
        body.append(f"| {label} | {', '.join(f'{m:.1f}' for m in med)} | {', '.join(f'{f:.0f}' for f in faults)} |")
    body += ["", f"Defaults / kept, mean of the per-process medians: **{off_med / on_med:.2f}x**."]
    write_section(for_model("host-memory", args.model), "\n".join(body))
    out = {"runs": runs, "ratio": off_med / on_med, "machine": machine()}
    if not is_default_model(args.model):
        out["model"] = args.model
    save_results(for_model("host_memory", args.model, "_"), out)
    print("\n".join(body))


if __name__ == "__main__":
    main()
