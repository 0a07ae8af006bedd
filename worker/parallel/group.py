"""The ranks of one worker joined with torch.distributed.

Two process groups over one TCP store on 127.0.0.1 (rank 0 hosts it):

- the **data** group carries the model's collectives (all-reduce after row-parallel products and
  the vocabulary-parallel embedding, the gather of the LM head's logits): NCCL on CUDA, gloo on
  CPU, with ``timeout_s`` so that a rank that stops answering fails the step rather than hanging it;
- the **control** group (always gloo, on the host) carries rank 0's commands: each step's flat
  batch, the KV cache's size. Followers wait on it between steps, so its timeout is long; a
  follower whose rank 0 dies is killed with it (``PR_SET_PDEATHSIG``, worker/engine/follower.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CONTROL_TIMEOUT", "RankGroup", "connect_store", "host_store", "join"]

CONTROL_TIMEOUT = timedelta(days=365)
"""Followers wait on the control group between steps for as long as the worker idles."""


@dataclass
class RankGroup:
    """This process's place among a worker's tensor-parallel ranks."""

    rank: int
    size: int
    data: Any  # the data process group (dist.ProcessGroup)
    control: Any  # the control process group (gloo)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place."""
        dist.all_reduce(x, group=self.data)
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:  # [L, rows] -> [L, width] on rank 0
        """Every rank's ``x`` side by side on rank 0, cut to ``width`` columns (vocabulary
        padding dropped); an empty tensor on the other ranks."""
        x = x.contiguous()
        if x.shape[0] == 0:  # every rank runs the same batch: none of them has rows to send
            return x.new_empty(0, width)
        if not self.is_leader:
            dist.gather(x, None, dst=0, group=self.data)
            return x.new_empty(0)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0, group=self.data)
        return torch.cat(parts, dim=1)[:, :width]

    def send(self, message: Any) -> None:
        """Rank 0: hand ``message`` (any picklable object) to every follower."""
        assert self.is_leader
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> Any:
        """A follower: the next message rank 0 sends."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank brings (every rank calls it)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value`` on rank 0 (an empty list elsewhere)."""
        out: list[Any] | None = [None] * self.size if self.is_leader else None
        dist.gather_object(value, out, dst=0, group=self.control)
        return out or []

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def host_store(size: int, timeout_s: float) -> Any:
    """Rank 0's TCP store on a free port of 127.0.0.1 (``.port``), made before the followers
    start so that they can be told where it is."""
    return dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        "127.0.0.1", 0, world_size=size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join(rank: int, size: int, store: Any, device: torch.device, timeout_s: float) -> RankGroup:
    """Join the worker's ranks over ``store`` (rank 0's :func:`host_store`; a follower's
    ``dist.TCPStore`` client of it); every rank calls this with the same ``size``."""
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # waits between steps must not time out
    return RankGroup(rank=rank, size=size, data=dist.group.WORLD, control=control)


def connect_store(port: int, size: int, timeout_s: float) -> Any:
    """A follower's client of rank 0's store."""
    store = dist.TCPStore  # pyright: ignore[reportPrivateImportUsage]
    return store("127.0.0.1", port, world_size=size, is_master=False, timeout=timedelta(seconds=timeout_s))
