"""Cost of one batch-1 decode step of each embedded default model, on our runtime and on
transformers (float32, eager, KV cache of ``--context`` tokens), and the draft/target ratio
that decides what speculation can gain.

    python bench/bench_decode_step.py [--context 128] [--threads 2]

Writes docs/benchmarks.md (section ``decode-step``) and bench/results/decode_step.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, machine, write_section  # noqa: E402

from draftwise.worker import default_model_path  # noqa: E402
from draftwise.worker.model.kv_cache import KVCache  # noqa: E402
from draftwise.worker.model.loader import load_model  # noqa: E402
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk  # noqa: E402


def ours_ms(which: str, context: int, steps: int) -> float:
    loaded = load_model(default_model_path(which), dtype="float32")
    blocks = -(-(context + steps + 8) // 16)
    runner = ModelRunner(loaded, KVCache(loaded.config, blocks, 16, torch.float32, "cpu"))
    table = list(range(blocks))
    ids = [1] + [5 + i % 100 for i in range(context - 1)]
    logits = runner.run([SequenceChunk(ids, 0, table)])
    times = []
    for i in range(steps):
        tok = int(logits[-1].argmax())
        t = time.perf_counter()
        logits = runner.run([SequenceChunk([tok], context + i, table)])
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[steps // 4 :])


@torch.no_grad()
def hf_ms(which: str, context: int, steps: int) -> float:
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(
        default_model_path(which), dtype=torch.float32, local_files_only=True
    ).eval()
    ids = torch.tensor([[1] + [5 + i % 100 for i in range(context - 1)]])
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    times = []
    for _ in range(steps):
        nxt = out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[steps // 4 :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    r: dict = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "context": args.context}
    for which in ("target", "draft"):
        r[which] = {
            "ours_ms": ours_ms(which, args.context, args.steps),
            "hf_ms": hf_ms(which, args.context, args.steps),
        }
    r["draft_over_target_ours"] = r["draft"]["ours_ms"] / r["target"]["ours_ms"]
    r["draft_over_target_hf"] = r["draft"]["hf_ms"] / r["target"]["hf_ms"]
    print(json.dumps(r, indent=1))
    out = ROOT / "bench" / "results" / "decode_step.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(r, indent=1) + "\n")
    write_section(
        "decode-step",
        f"""## Decode step of the default models (batch 1, float32, context {args.context})

Command: `python bench/bench_decode_step.py` — {r["date"]}, {r["machine"]}

| model | draftwise (ms) | transformers (ms) | transformers / draftwise |
| --- | --- | --- | --- |
| target | {r["target"]["ours_ms"]:.2f} | {r["target"]["hf_ms"]:.2f} | {r["target"]["hf_ms"] / r["target"]["ours_ms"]:.2f}x |
| draft | {r["draft"]["ours_ms"]:.2f} | {r["draft"]["hf_ms"]:.2f} | {r["draft"]["hf_ms"] / r["draft"]["ours_ms"]:.2f}x |
| draft / target | {r["draft_over_target_ours"]:.3f} | {r["draft_over_target_hf"]:.3f} | |
""",
    )


if __name__ == "__main__":
    main()
