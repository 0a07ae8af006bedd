"""The tensor-parallel row of ``check_gpu.py``: the embedded target served with
``tensor_parallel_size=2`` (NCCL between two devices, each rank capturing its own CUDA graphs)
against one device, greedy: tokens equal, tokens/s of each, graphs captured on rank 0. With
fewer than two CUDA devices the row says so and checks nothing; ``--dry-run`` runs it on CPU
with gloo (two processes)."""

from __future__ import annotations

import time
from typing import Any

import torch

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\ndef main(",
    "class Stack:\n    def __init__(self):",
    "def read_config(path):\n    with open(path) as f:",
]


def check_tensor_parallel(ctx: Any, Row: Any, graph_runners: Any, rows: list[Any]) -> None:  # noqa: N803
    """``Row`` and ``graph_runners``: the driver's row type and graph counter."""
    from draftwise.worker import LLM, SamplingParams

    devices = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    if ctx.device.type == "cuda" and devices < 2:
        rows.append(Row("tp", "tensor parallel TP=2", f"not run: {devices} CUDA device (needs >= 2)", "runs", None))
        return
    dtype = "float32"  # equality across ranks: float32 (bfloat16 sums in another order can flip an argmax)
    params = SamplingParams(temperature=0, max_tokens=ctx.e2e_tokens, ignore_eos=True)
    batch = (PROMPTS * 16)[: max(ctx.e2e_batches)]
    got: dict[int, list[list[int]]] = {}
    for tp in (1, 2):
        llm = LLM(device=ctx.device.type, dtype=dtype, max_num_seqs=len(batch), max_model_len=1024,
                  kv_cache_memory_bytes=(64 << 20) if ctx.dry else (4 << 30), tensor_parallel_size=tp)  # fmt: skip
        try:
            graphs = sum(g.num_graphs for g in graph_runners(llm))
            llm.generate(batch[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            got[tp] = [list(o.outputs[0].token_ids) for o in outs]
            toks = sum(len(t) for t in got[tp])
            rows.append(
                Row("tp", f"TP={tp} {dtype} batch {len(batch)}", f"{toks / dt:.0f} tok/s, {graphs} graphs on rank 0",
                    "", None)
            )  # fmt: skip
        finally:
            if llm.engine.ranks is not None:
                llm.engine.ranks.close()
            del llm
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(got[1], got[2], strict=True))
    rows.append(
        Row("tp", "TP=2 greedy equals TP=1", f"{same}/{len(got[1])} requests equal", "all", same == len(got[1]))
    )
