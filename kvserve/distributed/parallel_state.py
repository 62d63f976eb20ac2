"""This process's tensor-parallel group: its rank, the group size and the two collectives the layers need.

One group per process, set once by the Worker before the model is built (`init_tensor_parallel`) and read by the
parallel layers when they are constructed, so a layer's choice between local and collective code is made once.
Without a call the process is rank 0 of a group of one and no collective runs: the uniproc engine and the layer
unit tests never touch torch.distributed.

When every rank is on this machine the collectives of CPU tensors go through a shared-memory segment
(shm_comm.py: tens of microseconds where gloo takes a millisecond); across machines, for tensors larger than the
segment's buffers, or with KVSERVE_TP_COMM=gloo, they go through torch.distributed: gloo on the CPU (the only
backend this package has run), NCCL for GPU tensors when that path exists.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kvserve.distributed import shm_comm
from kvserve.distributed.shm_comm import ShmCommunicator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world_size: int
    shm: ShmCommunicator | None = field(default=None, compare=False, repr=False)  # when all ranks are local

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.world_size == 1:
            return x
        if self.shm is not None and self.shm.fits(x) and x.is_contiguous():
            return self.shm.all_reduce(x)
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` (same shape on each) along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x.contiguous(), dim)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)


_SINGLE = TPGroup(0, 1)
_group: TPGroup = _SINGLE


def get_tp_group() -> TPGroup:
    return _group


# Per rank and per buffer (two each): a decode step's activations and logits, and prefill chunks of a small
# model, fit; larger tensors take gloo, where their size amortizes its latency.
SHM_BUFFER_BYTES = 8 << 20


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    shm_buffer_bytes: int = SHM_BUFFER_BYTES,
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
    shm = None
    if world_size > 1 and backend == "gloo" and os.environ.get("KVSERVE_TP_COMM", "shm") != "gloo":
        shm = _open_shm(rank, world_size, shm_buffer_bytes, timeout_s)
    _group = TPGroup(rank, world_size, shm)
    return _group


def _open_shm(rank: int, world_size: int, buffer_bytes: int, timeout_s: float) -> ShmCommunicator | None:
    """The shared segment, if every rank can map it: rank 0 makes it and sends its path and token over gloo; a
    rank on another machine finds no file with that token. Every rank reaches the same answer (an all-reduce of
    the votes), and the file is unlinked once all have mapped it, so nothing is left in /dev/shm after exit."""
    made: list = [None]
    if rank == 0 and shm_comm.supported():
        try:
            made[0] = ShmCommunicator.create(world_size, buffer_bytes)
        except OSError as e:
            logger.warning("no shared-memory segment for the TP collectives (%s); using gloo", e)
    dist.broadcast_object_list(made, src=0)
    path_token = made[0]
    ok = path_token is not None and shm_comm.supported() and ShmCommunicator.holds_token(*path_token, world_size)
    vote = torch.tensor([1 if ok else 0])
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    comm = None
    if vote.item() == 1:
        # NOTE: a little under the executor's step timeout (the same timeout_s), so that a rank left waiting for
        # a hung peer fails first and names that peer, rather than the executor blaming the step as a whole.
        comm = ShmCommunicator(path_token[0], rank, world_size, buffer_bytes, 0.9 * timeout_s)
    dist.barrier()  # every rank has mapped it (or given up)
    if rank == 0 and path_token is not None:
        os.unlink(path_token[0])
    if comm is not None:
        logger.info("rank %d: TP collectives through shared memory (%d MiB buffers)", rank, buffer_bytes >> 20)
    else:
        logger.info("rank %d: TP collectives through gloo (the ranks do not share a machine)", rank)
    return comm


def destroy_tensor_parallel() -> None:
    global _group
    if _group.shm is not None:
        _group.shm.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _group = _SINGLE
