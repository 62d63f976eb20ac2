"""Size and allocate the paged KV cache from a memory budget (not per request)."""

from __future__ import annotations

import logging
import mmap
import os

import torch

from kvserve.attention.base import KVCache
from kvserve.config import ArchConfig, CacheConfig

logger = logging.getLogger(__name__)

# Default budget when none is given: this share of the memory available after the weights are loaded,
# capped like vLLM's CPU backend default (4 GiB).
_DEFAULT_FRACTION = 0.4
_DEFAULT_CAP = 4 << 30


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_hidden_layers * block_size * arch.num_key_value_heads * arch.head_dim * element


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_blocks_for(cache_config: CacheConfig, arch: ArchConfig, dtype: torch.dtype) -> int:
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    budget = cache_config.kv_cache_memory
    if budget is None:
        budget = min(int(available_memory() * _DEFAULT_FRACTION), _DEFAULT_CAP)
    per_block = bytes_per_block(arch, cache_config.block_size, dtype)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={budget} bytes holds no block of {per_block} bytes; raise kv_cache_memory")
    logger.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens)",
        num_blocks,
        cache_config.block_size,
        num_blocks * per_block / 2**30,
        num_blocks * cache_config.block_size,
    )
    return int(num_blocks)


def allocate_kv_cache(num_blocks: int, block_size: int, arch: ArchConfig, dtype: torch.dtype) -> list[KVCache]:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim], all zero.

    The memory must be zero, not garbage: padded slots of a gathered context get attention weight 0, and
    0 * NaN from stale memory would still poison the sum. One anonymous mapping gives zeroed memory whose pages
    the kernel supplies on first write, so start-up does not pay for touching gigabytes (torch.zeros of 4 GiB
    takes ~6 s here); huge pages are requested to cut the page faults and TLB misses that remain.
    """
    shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    per_tensor = num_blocks * block_size * arch.num_key_value_heads * arch.head_dim
    num_tensors = 2 * arch.num_hidden_layers
    element = torch.empty((), dtype=dtype).element_size()
    # Private, not Python's default shared mapping: shared anonymous memory is shmem, which gets no huge pages.
    buf = mmap.mmap(-1, num_tensors * per_tensor * element, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(buf, dtype=dtype)  # keeps `buf` alive
    tensors = [flat[i * per_tensor : (i + 1) * per_tensor].view(shape) for i in range(num_tensors)]
    return [(tensors[2 * i], tensors[2 * i + 1]) for i in range(arch.num_hidden_layers)]
