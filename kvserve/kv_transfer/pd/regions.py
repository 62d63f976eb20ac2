"""A rank's KV pool as raw memory: every tensor that holds part of a block (K and V of each layer, then the pools that
mirror the block ids, e.g. a draft model's), each `[num_blocks, ...]` with one block contiguous in it. Blocks move
as byte ranges of these tensors, straight from one pool into the other: vectored socket calls (`sendmsg` /
`recvmsg_into`) over many ranges at once, or Mooncake descriptors.

Byte order on the wire (tcp): for each tensor in order, the blocks in the consumer's order. Both sides know it from
the block lists alone, so nothing but the bytes is sent.
"""

from __future__ import annotations

import ctypes
import socket

import torch

from kvserve.kv_transfer.pd.runs import paired_runs, runs

_IOV_MAX = 512  # ranges per vectored call (Linux allows 1024)


class KVRegions:
    def __init__(self, pools: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """`pools`: the pool's per-layer (K, V), then each mirror pool's."""
        tensors = [t for pool in pools for kv in pool for t in kv]
        if any(t.device.type != "cpu" for t in tensors):
            raise ValueError("the pd connector moves KV between CPU pools only (GPU pools need a device transport)")
        self._tensors = tensors  # keeps the memory alive
        self.num_blocks = tensors[0].shape[0]
        self.bases = [t.data_ptr() for t in tensors]
        self.block_bytes = [t[0].numel() * t.element_size() for t in tensors]
        for t in tensors:
            if not t.is_contiguous() or t.shape[0] != self.num_blocks:
                raise ValueError("every KV tensor must be contiguous with one row per block")

    def memory_ranges(self) -> list[tuple[int, int]]:
        """(address, bytes) of the pool's memory, adjacent tensors merged (to register with Mooncake)."""
        spans = sorted((b, n * self.num_blocks) for b, n in zip(self.bases, self.block_bytes, strict=True))
        out: list[tuple[int, int]] = []
        for addr, size in spans:
            if out and out[-1][0] + out[-1][1] == addr:
                out[-1] = (out[-1][0], out[-1][1] + size)
            else:
                out.append((addr, size))
        return out

    def check_ids(self, block_ids: list[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:4]} out of range (the pool has {self.num_blocks} blocks)")

    def nbytes(self, num_blocks: int) -> int:
        return num_blocks * sum(self.block_bytes)

    def _view(self, addr: int, size: int) -> memoryview:
        return memoryview((ctypes.c_char * size).from_address(addr)).cast("B")

    def send_views(self, src_ids: list[int], dst_ids: list[int]) -> list[memoryview]:
        """The byte ranges of `src_ids`'s blocks in wire order for a consumer writing them into `dst_ids`."""
        pairs = paired_runs(src_ids, dst_ids)
        return [
            self._view(base + s * size, n * size)
            for base, size in zip(self.bases, self.block_bytes, strict=True)
            for s, _, n in pairs
        ]

    def recv_views(self, dst_ids: list[int]) -> list[memoryview]:
        spans = runs(dst_ids)
        return [
            self._view(base + d * size, n * size)
            for base, size in zip(self.bases, self.block_bytes, strict=True)
            for d, n in spans
        ]

    def mooncake_batch(
        self, src_ids: list[int], dst_ids: list[int], dst_bases: list[int]
    ) -> tuple[list[int], list[int], list[int]]:
        """(source addresses, destination addresses, lengths): one descriptor per contiguous run per tensor."""
        pairs = paired_runs(src_ids, dst_ids)
        srcs, dsts, lens = [], [], []
        for base, dst_base, size in zip(self.bases, dst_bases, self.block_bytes, strict=True):
            for s, d, n in pairs:
                srcs.append(base + s * size)
                dsts.append(dst_base + d * size)
                lens.append(n * size)
        return srcs, dsts, lens


def send_all(sock: socket.socket, views: list[memoryview]) -> int:
    """Send every range in order (vectored, partial sends resumed). Returns the bytes sent."""
    total = 0
    i, offset = 0, 0
    while i < len(views):
        batch = [views[i][offset:], *views[i + 1 : i + _IOV_MAX]]
        sent = sock.sendmsg(batch)
        total += sent
        while sent > 0:
            left = len(views[i]) - offset
            if sent >= left:
                sent -= left
                i, offset = i + 1, 0
            else:
                offset += sent
                sent = 0
        while i < len(views) and offset == len(views[i]):  # empty ranges
            i, offset = i + 1, 0
    return total


def recv_all(sock: socket.socket, views: list[memoryview]) -> int:
    """Fill every range in order, straight from the socket (no staging copy). ConnectionError on EOF."""
    total = 0
    i, offset = 0, 0
    while i < len(views):
        if offset == len(views[i]):
            i, offset = i + 1, 0
            continue
        batch = [views[i][offset:], *views[i + 1 : i + _IOV_MAX]]
        got = sock.recvmsg_into(batch)[0]
        if got == 0:
            raise ConnectionError("the producer closed the connection mid-transfer")
        total += got
        while got > 0:
            left = len(views[i]) - offset
            if got >= left:
                got -= left
                i, offset = i + 1, 0
            else:
                offset += got
                got = 0
    return total
