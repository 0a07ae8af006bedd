"""Cost of one batch-1 decode step of each embedded default model, on our runtime and on
transformers (float32, eager, KV cache of ``--context`` tokens), and the draft/target ratio
that decides what speculation can gain; and, in the same run, our target's decode step at
batch 1, 8 and 64 with its weights stored ``[in, out]`` (the CPU default) and ``[out, in]``.

    python bench/bench_decode_step.py [--context 128] [--threads 2]

Writes docs/benchmarks.md (section ``decode-step``) and bench/results/decode_step.json.
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
from benchlib import machine, save_results, write_section  # noqa: E402

from draftwise.worker import default_model_path  # noqa: E402
from draftwise.worker.model.kv_cache import KVCache  # noqa: E402
from draftwise.worker.model.loader import load_model  # noqa: E402
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk  # noqa: E402


def ours_ms(which: str, context: int, steps: int, batch: int = 1, layout: int | None | str = "default") -> float:
    """Median milliseconds of one decode step of ``batch`` sequences at ``context`` tokens,
    with the weights laid out for ``layout`` threads (None: as in the checkpoint)."""
    loaded = load_model(default_model_path(which), dtype="float32")
    if layout != "default":
        loaded.model.set_cpu_layout(layout)
    per_seq = -(-(context + steps + 8) // 16)
    runner = ModelRunner(loaded, KVCache(loaded.config, per_seq * batch, 16, torch.float32, "cpu"))
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    ids = [1] + [5 + i % 100 for i in range(context - 1)]
    logits = runner.run([SequenceChunk(ids, 0, t) for t in tables])
    times = []
    for i in range(steps):
        toks = logits.argmax(-1).tolist()
        t = time.perf_counter()
        logits = runner.run([SequenceChunk([tok], context + i, tb) for tok, tb in zip(toks, tables, strict=True)])
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[steps // 4 :])


LAYOUTS = {"out_in": None, "in_out": 1, "blocks": torch.get_num_threads}


def layout_rows(context: int, steps: int, batches=(1, 8, 64), rounds: int = 3) -> list[dict]:
    """The target's step with its weights as in the checkpoint (``[out, in]``), ``[in, out]``,
    and in column blocks, one per thread (the CPU default), alternating, the faster of
    ``rounds`` runs of each."""
    rows = []
    for b in batches:
        n = max(20, steps // b)
        best = dict.fromkeys(LAYOUTS, float("inf"))
        for _ in range(rounds):
            for name, parts in LAYOUTS.items():
                parts = parts() if callable(parts) else parts
                best[name] = min(best[name], ours_ms("target", context, n, b, parts))
        rows.append({"batch": b, **{f"{k}_ms": v for k, v in best.items()}})
        print(json.dumps(rows[-1]), flush=True)
    return rows


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
    r["threads"] = torch.get_num_threads()
    for which in ("target", "draft"):
        r[which] = {
            "ours_ms": ours_ms(which, args.context, args.steps),
            "hf_ms": hf_ms(which, args.context, args.steps),
        }
    r["draft_over_target_ours"] = r["draft"]["ours_ms"] / r["target"]["ours_ms"]
    r["draft_over_target_hf"] = r["draft"]["hf_ms"] / r["target"]["hf_ms"]
    r["layout"] = layout_rows(args.context, args.steps)
    print(json.dumps(r, indent=1))
    save_results("decode_step", r)
    write_section("decode-step", render(r))


def render(r: dict) -> str:
    threads = r.get("threads") or r["machine"].split(", ")[-1].split()[0]  # machine() ends with "N threads"
    return f"""## Decode step of the default models (batch 1, float32, context {r["context"]})

Command: `python bench/bench_decode_step.py` — {r["date"]}, {r["machine"]}

| model | draftwise (ms) | transformers (ms) | transformers / draftwise |
| --- | --- | --- | --- |
| target | {r["target"]["ours_ms"]:.2f} | {r["target"]["hf_ms"]:.2f} | {r["target"]["hf_ms"] / r["target"]["ours_ms"]:.2f}x |
| draft | {r["draft"]["ours_ms"]:.2f} | {r["draft"]["hf_ms"]:.2f} | {r["draft"]["hf_ms"] / r["draft"]["ours_ms"]:.2f}x |
| draft / target | {r["draft_over_target_ours"]:.3f} | {r["draft_over_target_hf"]:.3f} | |

### CPU weight layout (target, decode step, same run)

On CPU the model lays each projection's weight out for the intra-op threads (`LlamaModel.set_cpu_layout`,
docs/models.md): one thread gets `[in, out]`, `p` threads get `p` column blocks multiplied as one batched
product (one block per thread). Same run, same steps:

| batch | `[out, in]`, checkpoint (ms) | `[in, out]` (ms) | column blocks, {threads} threads (ms) | checkpoint / blocks |
| --- | --- | --- | --- | --- |
""" + "".join(
        f"| {x['batch']} | {x['out_in_ms']:.2f} | {x['in_out_ms']:.2f} | {x['blocks_ms']:.2f} | "
        f"**{x['out_in_ms'] / x['blocks_ms']:.2f}x** |\n"
        for x in r["layout"]
    )


if __name__ == "__main__":
    main()
