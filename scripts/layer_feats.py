"""Earlier layers' features for existing head data (EAGLE-3's fused features): re-read every
sequence of the shards in ``--data`` teacher-forced (prefill passes only) and keep the residual
stream after each layer of ``--layers`` at every fed position, float16, in ``--out`` (one
``<shard>.pt`` per shard: ``{"layers": [...], "feats": float16 [sum (L - 1), len(layers), hidden],
"final_diff": max |recomputed final feature - stored|}``).

    python scripts/layer_feats.py --model smollm2-135m-instruct --data .cache/heads/smollm2/data \\
        --out .cache/heads/smollm2/layers --layers 2,15
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_heads_data import PREFILL_TOKENS, teacher_forced  # noqa: E402

from draftwise.worker.core.block_manager import BlockManager  # noqa: E402
from draftwise.worker.model.kv_cache import KVCache  # noqa: E402
from draftwise.worker.model.loader import load_model  # noqa: E402
from draftwise.worker.model.model_runner import ModelRunner  # noqa: E402
from draftwise.worker.paths import resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", default="2,15", help="layer indices (0-based) whose output stream is kept")
    args = ap.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    loaded = load_model(resolve_model(args.model), dtype="float32")
    bs, pool = 16, 2048 // 16 * 3 + 64
    blocks = BlockManager(pool, bs)
    runner = ModelRunner(loaded, KVCache(loaded.config, pool, bs, loaded.dtype, loaded.device))
    captured: dict[int, torch.Tensor] = {}

    def hook(i: int):
        def keep(_module, _inputs, output) -> None:
            x, residual = output
            captured[i] = (x + residual).to(torch.float16)

        return keep

    for i in layers:
        loaded.model.layers[i].register_forward_hook(hook(i))
    args.out.mkdir(parents=True, exist_ok=True)
    t0, done = time.perf_counter(), 0
    for path in sorted(args.data.glob("*_[0-9][0-9][0-9].pt")):
        dest = args.out / path.name
        if dest.exists():
            continue
        d = torch.load(path)
        seqs, at = [], 0
        for n in d["lengths"]:
            seqs.append(d["tokens"][at : at + n].tolist())
            at += n
        parts: list[torch.Tensor] = []
        finals: list[torch.Tensor] = []
        lo = 0
        while lo < len(seqs):  # groups that fit one prefill pass: the hooks see exactly their rows
            hi, used = lo + 1, len(seqs[lo])
            while hi < len(seqs) and used + len(seqs[hi]) <= PREFILL_TOKENS:
                used += len(seqs[hi])
                hi += 1
            finals += teacher_forced(runner, blocks, seqs[lo:hi])
            row = 0
            for s in seqs[lo:hi]:
                parts.append(torch.stack([captured[i][row : row + len(s) - 1] for i in layers], dim=1))
                row += len(s)
            lo = hi
        diff = (torch.cat(finals).float() - d["feats"].float()).abs().max().item()
        torch.save({"layers": layers, "feats": torch.cat(parts), "final_diff": diff}, dest)
        done += sum(d["lengths"])
        print(
            f"{path.name}: {done} tokens, {done / (time.perf_counter() - t0):.0f} tok/s, final diff {diff:.3g}",
            flush=True,
        )


if __name__ == "__main__":
    main()
