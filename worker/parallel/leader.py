"""Rank 0's side of a tensor-parallel worker: it starts the other ranks, joins them, and from
then on runs the engine as usual; its ModelRunner tells the ranks each forward pass to run
(``ModelRunner.forward_batch``), and every rank runs it on its shard.

The other ranks are processes of their own (``python -m draftwise.worker.engine.follower``),
started before the target loads so that every rank reads its shard at the same time. A watchdog
thread waits on them: a rank that exits while the worker runs is recorded
(:meth:`Ranks.failure`), the engine's next step (or, idle, its next health check) stops with
EngineDeadError naming it, and the worker process exits non-zero for its supervisor to restart
it. A collective that a dead rank never joins fails when its connection closes, or after
``DATA_TIMEOUT_S`` at the latest: nothing hangs.
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import structlog
import torch

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.core.containment import EngineDeadError
from draftwise.worker.model.loader import read_config
from draftwise.worker.model.sharding import Shard
from draftwise.worker.parallel.group import RankGroup, host_store, join

log = structlog.get_logger("draftwise.parallel")

__all__ = ["CONFIG_KEY", "DATA_TIMEOUT_S", "Ranks", "rank_device"]

CONFIG_KEY = "draftwise/config"
"""The store key holding the EngineConfig (pickled) the followers start from."""
DATA_TIMEOUT_S = 60.0
"""Longest wait in one of the model's collectives (and for the ranks to join at start)."""


def rank_device(device: str, rank: int) -> torch.device:
    """The device of ``rank``: the CPU for every rank on CPU; on CUDA one device each, counted
    from the configured one (``cuda`` / ``cuda:0`` -> rank r on ``cuda:r``)."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank)


class Ranks:
    """The followers of one tensor-parallel worker, as rank 0 holds them."""

    def __init__(self, config: EngineConfig, folder: str) -> None:
        size = config.tensor_parallel_size
        model = read_config(folder)
        try:  # before any rank starts: a model the ranks cannot share is refused at once
            for r in range(size):
                Shard.plan(model, r, size)
        except ValueError as e:
            raise ValueError(f"{folder}: {e}") from None
        device = rank_device(config.device, 0)
        if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={size} needs {size} CUDA devices from {device}; "
                f"this machine has {torch.cuda.device_count()}"
            )
        self.size = size
        self.threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else torch.get_num_threads()
        store = host_store(size, DATA_TIMEOUT_S)
        store.set(CONFIG_KEY, pickle.dumps(config))  # the followers' device comes from it, before they join
        self._stopping = False
        self._threads_before = torch.get_num_threads()
        self._failure: str | None = None
        self._exited = threading.Event()  # set once a rank's exit is recorded
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        args = ["--size", str(size), "--port", str(store.port), "--parent-pid", str(os.getpid())]
        args += ["--threads", str(self.threads)]
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-P", "-m", "draftwise.worker.engine.follower", "--rank", str(r), *args], env=env
            )
            for r in range(1, size)
        ]
        atexit.register(self.close)
        for r, p in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(r, p), name=f"tp-rank-{r}-watchdog", daemon=True).start()
        if device.type == "cpu":
            torch.set_num_threads(self.threads)  # the ranks share the cores (until close)
        try:
            self.group: RankGroup = join(0, size, store, device, DATA_TIMEOUT_S)
        except Exception as e:
            self.close()
            raise EngineDeadError(f"tensor-parallel ranks did not join: {self._failure or repr(e)}") from e
        self.announce(("load", folder))
        log.info("tensor-parallel ranks joined", ranks=size, threads_per_rank=self.threads, device=str(device))

    @property
    def parallel(self) -> tuple[int, int, RankGroup]:
        """What ``load_model(parallel=...)`` takes for rank 0."""
        return 0, self.size, self.group

    def announce(self, message: tuple[Any, ...]) -> None:
        """Tell every other rank what to run next (they run it as rank 0 does)."""
        self.check()
        self.group.send(message)

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Why a rank stopped, once one has (None while all run). A collective can fail on a
        dead rank's closed connection before its process is reaped: a caller that saw one waits
        up to ``wait_s`` for the watchdog to record the exit."""
        if self._failure is None and wait_s > 0:
            self._exited.wait(wait_s)
        return self._failure

    def check(self) -> None:
        """EngineDeadError when a rank has stopped."""
        if self._failure is not None:
            raise EngineDeadError(self._failure)

    def agree_kv_blocks(self, size_here: Callable[[], Any], max_batched: int, max_model_len: int) -> Any:
        """Size the KV cache on every rank at once (each measures what its own memory holds:
        on CUDA the profile's forward passes run on all of them) and keep the smallest block
        count; ``size_here()`` is rank 0's ``(blocks, profile)``. The ranks then allocate it."""
        self.announce(("size", max_batched, max_model_len))
        blocks, profile = size_here()
        blocks = self.group.min_over_ranks(blocks)
        self.announce(("kv", blocks))
        return blocks, profile

    def memory(self, here: dict[str, int]) -> list[dict[str, int]]:
        """Each rank's memory (:func:`draftwise.worker.engine.follower.rank_memory`), rank 0's
        (``here``) first."""
        self.announce(("memory",))
        return self.group.gather_objects(here)

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._stopping:
            return
        self._failure = f"tensor-parallel rank {rank} exited with code {code}"
        self._exited.set()
        log.error("tensor-parallel rank exited: the worker stops", rank=rank, code=code)

    def close(self) -> None:
        """Stop the other ranks (they hold no state of their own: terminating them loses nothing)."""
        if self._stopping:
            return
        self._stopping = True
        group = getattr(self, "group", None)
        if group is not None:  # a process holds one default group: the next engine's ranks can join
            group.close()
        torch.set_num_threads(self._threads_before)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
