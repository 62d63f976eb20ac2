"""The swap space: a CPU memory area of whole blocks in the pool's own layout, for swap preemption.

With the pool on a GPU the area is pinned and the copies are asynchronous on the current stream: the step's
forward pass, queued after them on that stream, cannot overwrite a block being swapped out or read one being
swapped in before its copy is done, and nothing on the host reads the area (like vLLM's swap space)."""

from __future__ import annotations

import torch

from kvserve.attention.base import KVCache, blocks_view


class SwapSpace:
    """`pools`: the target's KV pool and any pool that mirrors its block ids (a draft model's), each moved with the
    same (device block, swap block) pairs, so a swapped-in request finds the draft's KV where it left it too."""

    def __init__(self, num_swap_blocks: int, pools: list[list[KVCache]]) -> None:
        # Each [num_blocks, 2 * num_layers, block_size, num_kv_heads, head_dim] in its own shape.
        self.pools = [blocks_view(kv_caches) for kv_caches in pools]
        # On the CPU, pages fault in on first use.
        pin = self.pools[0].device.type == "cuda"
        self.blocks = [
            torch.empty((num_swap_blocks, *pool.shape[1:]), dtype=pool.dtype, pin_memory=pin) for pool in self.pools
        ]
        self.non_blocking = pin

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, swap block) pairs: device -> swap."""
        for pool, blocks in zip(self.pools, self.blocks, strict=True):
            for device, swap in pairs:
                blocks[swap].copy_(pool[device], non_blocking=self.non_blocking)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, swap block) pairs: swap -> device."""
        for pool, blocks in zip(self.pools, self.blocks, strict=True):
            for device, swap in pairs:
                pool[device].copy_(blocks[swap], non_blocking=self.non_blocking)
