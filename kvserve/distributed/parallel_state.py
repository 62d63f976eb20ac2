"""This process's tensor-parallel group: its rank, the group size and the two collectives the layers need.

One group per process, set once by the Worker before the model is built (`init_tensor_parallel`) and read by the
parallel layers when they are constructed, so a layer's choice between local and collective code is made once.
Without a call the process is rank 0 of a group of one and no collective runs: the uniproc engine and the layer
unit tests never touch torch.distributed.

The collectives go through torch.distributed: gloo on the CPU (the only backend this package has run), NCCL for
GPU tensors when that path exists.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world_size: int

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` (same shape on each) along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)


_SINGLE = TPGroup(0, 1)
_group: TPGroup = _SINGLE


def get_tp_group() -> TPGroup:
    return _group


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, backend: str = "gloo", timeout_s: float = 600.0
) -> TPGroup:
    """Join the process group (blocks until every rank has joined) and make it this process's TP group.

    `init_method` is a torch.distributed rendezvous address, e.g. tcp://127.0.0.1:29500 (the driver's host and a
    free port). `timeout_s` bounds every collective: a peer that hangs fails the step instead of blocking forever
    (the executor notices dead peers much sooner, from their process or actor)."""
    global _group
    if world_size > 1:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        logger.info("rank %d/%d joined the %s group at %s", rank, world_size, backend, init_method)
    _group = TPGroup(rank, world_size)
    return _group


def destroy_tensor_parallel() -> None:
    global _group
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _group = _SINGLE
