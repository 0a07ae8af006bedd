"""Earlier layers' features for existing head data (EAGLE-3's fused features): re-read every
sequence of the shards in ``--data`` teacher-forced (prefill passes only) and keep the residual
stream after each layer of ``--layers`` at every fed position (the target's own forward hands them
over: ``LlamaModel.feature_layers``, as when serving a head that fuses them), float16, in ``--out`` (one
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
from distill_heads_data import teacher_forced  # noqa: E402

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
    loaded.model.feature_layers = tuple(layers)  # the forward returns their streams after the final state
    h = loaded.config.hidden_size
    bs, pool = 16, 2048 // 16 * 3 + 64
    blocks = BlockManager(pool, bs)
    runner = ModelRunner(loaded, KVCache(loaded.config, pool, bs, loaded.dtype, loaded.device))
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
        rows = torch.cat(teacher_forced(runner, blocks, seqs))  # [sum (L - 1), (1 + len(layers)) * hidden]
        diff = (rows[:, :h].float() - d["feats"].float()).abs().max().item()
        feats = rows[:, h:].reshape(rows.shape[0], len(layers), h).clone()
        torch.save({"layers": layers, "feats": feats, "final_diff": diff}, dest)
        done += sum(d["lengths"])
        print(
            f"{path.name}: {done} tokens, {done / (time.perf_counter() - t0):.0f} tok/s, final diff {diff:.3g}",
            flush=True,
        )


if __name__ == "__main__":
    main()
