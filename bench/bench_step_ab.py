"""Engine step time at batch 1 and batch 64, for A/B runs of two checkouts: run this file with
each checkout's interpreter (``--label`` names it), alternating, and compare the medians.

- ``batch1``: one greedy request (prompt 64 tokens, 128 new), the median decode step;
- ``batch64``: 64 greedy requests (prompts 16-256 tokens, 64 new each) arriving together, the
  median step while all 64 decode, and the whole workload's wall time.

    python bench/bench_step_ab.py [--model PATH] [--label NAME] [--threads 2]

Prints one JSON line; writes nothing. Uses only the engine's public API (``LLM``,
``LLMEngine.add_request`` / ``step``), so any checkout since the incremental API can run it.
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
from benchlib import heldout_prompts  # noqa: E402

from draftwise.worker import LLM, SamplingParams  # noqa: E402


def _steps(engine, prompts: list[list[int]], new: int) -> tuple[list[tuple[int, float]], float]:
    """(requests decoding, seconds) of every pure decode step, and the wall time of all."""
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out, t0 = [], time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        so = engine.step()
        dt = time.perf_counter() - t
        if so.stats.num_batched_tokens == so.stats.num_scheduled:  # one token each: a decode step
            out.append((so.stats.num_scheduled, dt))
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder or .gguf file (default: the embedded target)")
    ap.add_argument("--label", default="")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype="float32", max_model_len=1024, max_num_seqs=64)
    engine, tok = llm.engine, llm.get_tokenizer()
    one = heldout_prompts(tok, 1, (64, 64), seed=0)
    many = heldout_prompts(tok, 64, (16, 256), seed=1)
    _steps(engine, one, 16)  # warm-up
    b1, _ = _steps(engine, one, 128)
    _steps(engine, many[:8], 8)  # warm-up at a larger batch
    b64, wall = _steps(engine, many, 64)
    full = [dt for n, dt in b64 if n == 64]
    res = {
        "label": args.label,
        "model": args.model or "embedded target",
        "batch1_step_ms": round(statistics.median(dt for _, dt in b1) * 1e3, 2),
        "batch64_step_ms": round(statistics.median(full) * 1e3, 2),
        "batch64_steps": len(full),
        "batch64_wall_s": round(wall, 2),
    }
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
