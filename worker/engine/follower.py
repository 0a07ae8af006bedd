"""A tensor-parallel rank other than 0: ``python -m draftwise.worker.engine.follower``.

It joins rank 0's process groups, loads its shard of the target, and then does what rank 0
tells it, message by message (worker/parallel/leader.py): size the KV cache, allocate it, run a
forward pass (the same flat batch rank 0 runs, so that their collectives meet), capture CUDA
graphs, report its memory. It keeps no state of its own beyond its weights and KV cache, and
exits when rank 0 is gone (a watchdog polls the parent) or when a collective fails.
"""

from __future__ import annotations

import argparse
import os
import pickle
import resource
import sys
import threading
import time
from dataclasses import replace
from typing import Any

__all__ = ["main", "rank_memory"]


def _exit_with_parent(parent_pid: int) -> None:
    """Exit at once when the process that started this rank (rank 0) is gone."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.25)
        os._exit(3)

    threading.Thread(target=watch, name="tp-parent-watchdog", daemon=True).start()


def rank_memory(weight_bytes: int, kv_bytes: int) -> dict[str, int]:
    """What a rank holds: its weights, its KV cache, and its peak resident memory (bytes)."""
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def run(rank: int, size: int, port: int, threads: int) -> None:
    import torch

    from draftwise.logs import ensure_logging
    from draftwise.worker.engine.sizing import num_kv_blocks
    from draftwise.worker.model.kv_cache import KVCache
    from draftwise.worker.model.loader import LoadedModel, load_model
    from draftwise.worker.model.model_runner import ModelRunner
    from draftwise.worker.parallel.group import connect_store, join
    from draftwise.worker.parallel.leader import CONFIG_KEY, DATA_TIMEOUT_S, rank_device

    ensure_logging()
    torch.set_num_threads(threads)
    store = connect_store(port, size, DATA_TIMEOUT_S)
    config = pickle.loads(store.get(CONFIG_KEY))  # written by rank 0 before it joins: NCCL needs the device now
    device = rank_device(config.device, rank)
    group = join(rank, size, store, device, DATA_TIMEOUT_S)
    loaded: LoadedModel | None = None
    runner: ModelRunner | None = None
    while True:
        message: tuple[Any, ...] = group.receive()
        kind = message[0]
        if kind == "load":
            loaded = load_model(
                message[1],
                dtype=config.dtype,
                device=device,
                parallel=(rank, size, group),
                quantization=config.quantization,
            )
        elif kind == "size":
            assert loaded is not None
            blocks, _ = num_kv_blocks(config, loaded, None, message[1], message[2])
            group.min_over_ranks(blocks)
        elif kind == "kv":
            assert loaded is not None
            kv = KVCache(loaded.kv_config, message[1], config.block_size, loaded.dtype, loaded.device)
            runner = ModelRunner(loaded, kv)
        elif kind == "run":
            assert runner is not None
            batch = message[1]
            runner.forward_batch(replace(batch, block_tables=[list(t) for t in batch.block_tables]), message[2])
        elif kind == "graphs":
            assert runner is not None
            runner.enable_graphs(message[1], None, message[2])
        elif kind == "memory":
            assert loaded is not None
            group.gather_objects(rank_memory(loaded.weight_bytes, runner.kv_cache.num_bytes if runner else 0))
        else:
            raise RuntimeError(f"unknown message from rank 0: {kind!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftwise.worker.engine.follower")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="rank 0's TCP store on 127.0.0.1")
    p.add_argument("--parent-pid", type=int, required=True, help="rank 0's process: exit when it is gone")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this rank (CPU)")
    args = p.parse_args(argv)
    _exit_with_parent(args.parent_pid)
    if os.getppid() != args.parent_pid:
        return 3
    try:
        run(args.rank, args.size, args.port, args.threads)
    except Exception as e:  # rank 0 sees the collective fail; say why here
        print(f"draftwise tensor-parallel rank {args.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
