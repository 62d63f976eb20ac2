"""All-reduce and all-gather through one shared-memory segment, for the ranks of a TP group on one machine.

gloo's collectives between two local processes cost a millisecond or more each, whatever their size (loopback
TCP, its threads); a model step runs two per layer, so at batch-1 decode they cost more than the model
(docs/benchmarks.md). Here each rank copies its tensor into its own slot of a segment all ranks have mapped,
publishes the collective's sequence number, waits until every rank has published it, and reads every slot.

Layout: a header of one int64 sequence number per rank (each on its own cache line) and a line for the segment's
token, then per rank two data
buffers of `buffer_bytes`. Collective number s uses buffer s % 2, so a rank may write collective s+1 while a
slower peer still reads collective s: before any rank can reach s+2 (the same buffer again) it must have seen
every rank publish s+1, which each publishes only after finishing s. No other handshake is needed.

Contracts:
- every rank calls the same collectives in the same order with the same shapes (what SPMD model code does); the
  caller falls back to gloo for tensors larger than `buffer_bytes`, decided from the shape alone, so all ranks
  choose alike;
- the sum is taken in rank order from the same slot bytes on every rank, so all ranks hold bitwise identical
  results (they must sample identical tokens);
- waiting spins briefly, then yields the CPU, then sleeps in short naps: ranks often share cores with each other
  and with other work, and a rank that never gives up its core would starve the peer it waits for. A peer that
  never arrives makes the wait raise TimeoutError after `timeout_s`.
- NOTE: a flag store after a data store, and a flag load before data loads, stay in order on x86 (TSO) without
  fences; `supported()` keeps other architectures on gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
import uuid

import numpy as np
import torch

_LINE = 64  # bytes per sequence-number slot: one cache line, so ranks never write the same line
_SPIN_CHECKS = 200  # flag checks before yielding (a few hundred microseconds)
_YIELD_S = 2e-3  # then sched_yield for this long, then nap
_NAP_S = 5e-5


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class ShmCommunicator:
    def __init__(self, path: str, rank: int, world_size: int, buffer_bytes: int, timeout_s: float) -> None:
        """Map the segment at `path` (made by `create`); the file may be unlinked once every rank has mapped it."""
        self.rank = rank
        self.world_size = world_size
        self.buffer_bytes = buffer_bytes
        self.timeout_s = timeout_s
        self.header_bytes = _LINE * (world_size + 1)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, self.header_bytes + 2 * world_size * buffer_bytes)
        finally:
            os.close(fd)
        # [world_size] sequence numbers, one per cache line
        self._seq = np.ndarray((world_size,), np.int64, buffer=self._mm, offset=0, strides=(_LINE,))
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)  # the whole segment, for slot views
        self._count = 0  # collectives done by this rank

    @staticmethod
    def create(world_size: int, buffer_bytes: int) -> tuple[str, bytes]:
        """Make a zeroed segment in /dev/shm; returns its path and a random token written at its start, by which
        the other ranks check that they opened this very file (not a namesake on another machine)."""
        path = f"/dev/shm/kvserve-tp-{uuid.uuid4().hex}"
        size = _LINE * (world_size + 1) + 2 * world_size * buffer_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: on a full tmpfs this fails here instead of with SIGBUS on first touch.
            os.posix_fallocate(fd, 0, size)
            token = os.urandom(16)
            os.pwrite(fd, token, _LINE * world_size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return path, token

    @staticmethod
    def holds_token(path: str, token: bytes, world_size: int) -> bool:
        try:
            with open(path, "rb") as f:
                f.seek(_LINE * world_size)
                return f.read(len(token)) == token
        except OSError:
            return False

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.buffer_bytes

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks into `x` (contiguous, `fits`); returns it."""
        slots = self._exchange(x)
        torch.add(slots[0], slots[1], out=x)
        for s in slots[2:]:
            x.add_(s)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order (a new tensor)."""
        return torch.cat(self._exchange(x), dim=dim)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish `x`, wait for every rank's; views of all ranks' slots (valid until this rank's next-but-one
        collective)."""
        self._count += 1
        n = self._count
        nbytes = x.numel() * x.element_size()
        slots = [self._slot(r, n % 2, nbytes).view(x.dtype).view(x.shape) for r in range(self.world_size)]
        slots[self.rank].copy_(x)
        self._seq[self.rank] = n
        self._wait_all(n)
        return slots

    def _slot(self, rank: int, buf: int, nbytes: int) -> torch.Tensor:
        start = self.header_bytes + (2 * rank + buf) * self.buffer_bytes
        return self._bytes[start : start + nbytes]

    def _wait_all(self, n: int) -> None:
        seq = self._seq
        for _ in range(_SPIN_CHECKS):
            if seq.min() >= n:
                return
        start = time.monotonic()
        while seq.min() < n:
            waited = time.monotonic() - start
            if waited < _YIELD_S:
                os.sched_yield()
            elif waited < self.timeout_s:
                time.sleep(_NAP_S)
            else:
                late = [r for r in range(self.world_size) if seq[r] < n]
                raise TimeoutError(f"rank(s) {late} did not reach collective {n} within {self.timeout_s:g} s")

    def close(self) -> None:
        del self._seq, self._bytes
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a slot view: the mapping goes with the process
            pass
