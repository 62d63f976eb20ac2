"""Swap preemption's bookkeeping (vLLM V0's swap_space): which swap blocks hold which preempted request's KV.

Pure Python; the bytes live in the worker's `worker/swap.py`. A preempted request's blocks covering its computed
tokens are copied out (pairs of device block, swap block in the SchedulerOutput) and its device blocks freed; when
it resumes it gets fresh device blocks and the pairs copy back. A request that does not fit in the free swap blocks
is preempted by recompute instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SwapStats:
    num_swapped_out: int = 0  # preemptions by swap (cumulative)
    num_swapped_in: int = 0
    num_swap_fallbacks: int = 0  # preemptions that wanted swap but recomputed (swap space full)
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0


class SwapManager:
    def __init__(self, num_swap_blocks: int) -> None:
        self.num_blocks = num_swap_blocks
        self._free = list(range(num_swap_blocks - 1, -1, -1))
        self._held: dict[str, list[int]] = {}  # req_id -> swap block ids, in block order
        self.stats = SwapStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def swap_out(self, req_id: str, device_block_ids: list[int]) -> list[tuple[int, int]] | None:
        """Reserve swap blocks for these device blocks; None (nothing reserved) when they do not fit."""
        if len(device_block_ids) > len(self._free):
            self.stats.num_swap_fallbacks += 1
            return None
        swap_ids = [self._free.pop() for _ in device_block_ids]
        self._held[req_id] = swap_ids
        self.stats.num_swapped_out += 1
        self.stats.num_blocks_swapped_out += len(swap_ids)
        return list(zip(device_block_ids, swap_ids, strict=True))

    def swap_in(self, req_id: str, device_block_ids: list[int]) -> list[tuple[int, int]]:
        """Pairs that copy the request's swap blocks into its new device blocks; the swap blocks are free again
        (the copy runs before anything could reuse them: a step never both swaps out and in)."""
        swap_ids = self._held.pop(req_id)
        assert len(device_block_ids) >= len(swap_ids)
        self._free.extend(reversed(swap_ids))
        self.stats.num_swapped_in += 1
        self.stats.num_blocks_swapped_in += len(swap_ids)
        return list(zip(device_block_ids, swap_ids, strict=False))

    def drop(self, req_id: str) -> None:
        """A swapped request ended (aborted) without coming back."""
        self._free.extend(reversed(self._held.pop(req_id, [])))
