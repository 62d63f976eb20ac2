"""Size and allocate the paged KV cache from a memory budget (not per request)."""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading

import torch

from kvserve.attention.base import AttentionBackend, KVCache
from kvserve.config import CacheConfig

logger = logging.getLogger(__name__)

# Default budget when none is given: this share of the memory available after the weights are loaded,
# capped like vLLM's CPU backend default (4 GiB).
_DEFAULT_FRACTION = 0.4
_DEFAULT_CAP = 4 << 30
# GiB of KV cache when none is given, like vLLM's VLLM_CPU_KVCACHE_SPACE (the test suite sets it low: a tiny model's
# 4 GiB pool is half a million blocks, over a second of start-up per engine).
KVCACHE_SPACE_ENV = "KVSERVE_CPU_KVCACHE_SPACE"


def bytes_per_block(backend: AttentionBackend, block_size: int, num_layers: int, dtype: torch.dtype) -> int:
    """K and V of one block across all layers, in the backend's layout."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * math.prod(backend.kv_cache_shape(1, block_size)) * element


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_kv_budget() -> int:
    """Bytes of KV cache when neither kv_cache_memory nor num_kv_blocks is given."""
    space = os.environ.get(KVCACHE_SPACE_ENV)
    if space:
        try:
            gib = float(space)
        except ValueError:
            gib = 0.0
        if not gib > 0:
            raise ValueError(f"{KVCACHE_SPACE_ENV}={space!r}: give a positive number of GiB")
        return int(gib * 2**30)
    return min(int(available_memory() * _DEFAULT_FRACTION), _DEFAULT_CAP)


def num_blocks_for(
    cache_config: CacheConfig,
    backend: AttentionBackend,
    num_layers: int,
    dtype: torch.dtype,
    num_ranks: int = 1,
    extra_bytes_per_block: int = 0,
) -> int:
    """Blocks of `backend`'s layout that fit the budget; with `num_ranks` tensor-parallel ranks each holds its
    heads' share of every block and gets 1/num_ranks of the budget, so TP changes neither the memory used nor (with
    the heads split evenly) the number of blocks. `extra_bytes_per_block`: what another pool of the same block
    count (a draft model's) costs per block, paid from the same budget."""
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    budget = cache_config.kv_cache_memory
    if budget is None:
        budget = default_kv_budget()
    budget //= num_ranks
    per_block = bytes_per_block(backend, cache_config.block_size, num_layers, dtype) + extra_bytes_per_block
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


def allocate_kv_cache(
    backend: AttentionBackend,
    num_blocks: int,
    block_size: int,
    num_layers: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    """Per layer (K, V), each of the backend's `kv_cache_shape(num_blocks, block_size)`, all zero, on `device`.

    The memory must be zero, not garbage: padded slots of a gathered context get attention weight 0, and
    0 * NaN from stale memory would still poison the sum. On the CPU, one anonymous mapping gives zeroed memory
    whose pages the kernel supplies on first write, so start-up does not pay for touching gigabytes (torch.zeros
    of 4 GiB takes ~6 s here); the tensors are consecutive slices of it (prefault_kv_cache relies on that). No
    huge pages: in this VM a fresh 2 MiB page costs ~4x more to fault in than the 4 KiB pages it replaces, and
    decode reads measured no faster with them. Other devices get torch.zeros there.
    """
    shape = backend.kv_cache_shape(num_blocks, block_size)
    num_tensors = 2 * num_layers
    if torch.device(device).type == "cpu":
        per_tensor = math.prod(shape)
        element = torch.empty((), dtype=dtype).element_size()
        buf = mmap.mmap(-1, num_tensors * per_tensor * element, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        flat = torch.frombuffer(buf, dtype=dtype)  # keeps `buf` alive
        tensors = [flat[i * per_tensor : (i + 1) * per_tensor].view(shape) for i in range(num_tensors)]
    else:
        tensors = list(torch.zeros((num_tensors, *shape), dtype=dtype, device=device).unbind(0))
    return [(tensors[2 * i], tensors[2 * i + 1]) for i in range(num_layers)]


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def prefault_kv_cache(kv_caches: list[KVCache], stop: threading.Event | None = None) -> bool:
    """Make every page of the KV cache resident and writable without changing its contents, so it is safe while
    the engine runs. The first write to a fresh page is slow in this VM (~3 s per GiB: the host backs the page
    then): paid inside a forward pass, it stalls both compute threads (~5 s of a 55 s benchmark run over a
    4 GiB pool). Returns False if the kernel lacks MADV_POPULATE_WRITE (pages then fault in on first use) or
    `stop` was set."""
    tensors = [t for kv in kv_caches for t in kv]
    if not tensors or tensors[0].device.type != "cpu":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    # The tensors are consecutive slices of one mapping (allocate_kv_cache).
    start = min(t.data_ptr() for t in tensors)
    start -= start % mmap.PAGESIZE
    end = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
    chunk = 64 << 20
    for lo in range(start, end, chunk):
        if stop is not None and stop.is_set():
            return False
        if madvise(lo, min(chunk, end - lo), _MADV_POPULATE_WRITE) != 0:
            return False
    return True
