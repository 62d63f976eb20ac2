"""The swap space: a CPU memory area of whole blocks in the pool's own layout, for swap preemption."""

from __future__ import annotations

import torch

from kvserve.attention.base import KVCache


class SwapSpace:
    def __init__(self, num_swap_blocks: int, kv_caches: list[KVCache]) -> None:
        k = kv_caches[0][0]
        self.kv_caches = kv_caches
        # [2 * num_layers, num_swap_blocks, block_size, num_kv_heads, head_dim]; pages fault in on first use.
        self.blocks = torch.empty((2 * len(kv_caches), num_swap_blocks, *k.shape[1:]), dtype=k.dtype)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, swap block) pairs: device -> swap."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for layer, (k, v) in enumerate(self.kv_caches):
            self.blocks[2 * layer].index_copy_(0, dst, k[src])
            self.blocks[2 * layer + 1].index_copy_(0, dst, v[src])

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, swap block) pairs: swap -> device."""
        if not pairs:
            return
        dst = torch.tensor([p[0] for p in pairs])
        src = torch.tensor([p[1] for p in pairs])
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, dst, self.blocks[2 * layer][src])
            v.index_copy_(0, dst, self.blocks[2 * layer + 1][src])
