"""The swap space: a CPU memory area of whole blocks in the pool's own layout, for swap preemption.

With the pool on a GPU the area is pinned and the copies are asynchronous on the current stream: the step's
forward pass, queued after them on that stream, cannot overwrite a block being swapped out or read one being
swapped in before its copy is done, and nothing on the host reads the area (like vLLM's swap space)."""

from __future__ import annotations

import torch

from kvserve.attention.base import KVCache
from kvserve.worker.kv_cache import blocks_view


class SwapSpace:
    def __init__(self, num_swap_blocks: int, kv_caches: list[KVCache]) -> None:
        self.pool = blocks_view(kv_caches)  # [num_blocks, 2 * num_layers, block_size, num_kv_heads, head_dim]
        # [num_swap_blocks, 2 * num_layers, block_size, num_kv_heads, head_dim]; on the CPU, pages fault in on first
        # use.
        pin = self.pool.device.type == "cuda"
        self.blocks = torch.empty((num_swap_blocks, *self.pool.shape[1:]), dtype=self.pool.dtype, pin_memory=pin)
        self.non_blocking = pin

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, swap block) pairs: device -> swap."""
        for device, swap in pairs:
            self.blocks[swap].copy_(self.pool[device], non_blocking=self.non_blocking)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, swap block) pairs: swap -> device."""
        for device, swap in pairs:
            self.pool[device].copy_(self.blocks[swap], non_blocking=self.non_blocking)
