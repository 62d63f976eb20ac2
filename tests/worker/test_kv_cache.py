import math
import threading

import pytest
import torch

from kvserve.attention.base import blocks_view
from kvserve.attention.torch_ref import TorchRefAttentionBackend
from kvserve.config import CacheConfig
from kvserve.worker.kv_cache import (
    KVCACHE_SPACE_ENV,
    allocate_kv_cache,
    bytes_per_block,
    default_kv_budget,
    num_blocks_for,
    prefault_kv_cache,
)
from kvserve.worker.swap import SwapSpace

NUM_LAYERS = 3


def backend(dtype: torch.dtype = torch.bfloat16) -> TorchRefAttentionBackend:
    return TorchRefAttentionBackend(num_heads=4, num_kv_heads=2, head_dim=8, dtype=dtype)


def test_fresh_cache_is_zero_and_prefault_keeps_contents():
    caches = allocate_kv_cache(backend(), 200, 16, NUM_LAYERS, torch.bfloat16, "cpu")
    assert len(caches) == 3 and caches[0][0].shape == (200, 16, 2, 8)
    assert all(not t.any() for kv in caches for t in kv)
    caches[1][1][7] = 3.5  # written "by the engine" before the pages are populated
    caches[2][0][199, 15] = -1.0
    prefault_kv_cache(caches)  # False on kernels without MADV_POPULATE_WRITE; contents must not change either way
    assert (caches[1][1][7] == 3.5).all() and (caches[2][0][199, 15] == -1.0).all()
    assert int((caches[1][1] != 0).sum()) == 16 * 2 * 8 and int((caches[2][0] != 0).sum()) == 2 * 8
    assert not caches[0][0].any() and not caches[0][1].any()


def test_prefault_stops_when_asked():
    caches = allocate_kv_cache(backend(torch.float32), 64, 16, NUM_LAYERS, torch.float32, "cpu")
    stop = threading.Event()
    stop.set()
    assert prefault_kv_cache(caches, stop) is False


class _OtherLayout(TorchRefAttentionBackend):
    """A backend that wants heads before tokens inside a block."""

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, block_size, self.head_dim)


@pytest.mark.parametrize("device", ["cpu", "meta"])  # "meta": any non-CPU device takes the torch.zeros path
def test_allocation_follows_the_backends_shape_and_size(device):
    b = _OtherLayout(4, 2, 8, torch.float32)
    caches = allocate_kv_cache(b, 5, 16, NUM_LAYERS, torch.float32, device)
    assert len(caches) == NUM_LAYERS
    for k, v in caches:
        assert k.shape == v.shape == (5, 2, 16, 8)
        assert k.device.type == v.device.type == device and k.dtype == torch.float32
    total = sum(t.numel() * t.element_size() for kv in caches for t in kv)
    assert total == 5 * bytes_per_block(b, 16, NUM_LAYERS, torch.float32)
    assert bytes_per_block(b, 16, NUM_LAYERS, torch.bfloat16) == 2 * NUM_LAYERS * 16 * 2 * 8 * 2
    if device == "cpu":  # one mapping, consecutive slices (prefault_kv_cache relies on that)
        ptrs = [t.data_ptr() for kv in caches for t in kv]
        step = math.prod(k.shape) * 4
        assert ptrs == [ptrs[0] + i * step for i in range(2 * NUM_LAYERS)]


def test_num_blocks_from_a_budget_uses_the_backends_block_size():
    per_block = bytes_per_block(backend(), 16, NUM_LAYERS, torch.bfloat16)
    config = CacheConfig(block_size=16, kv_cache_memory=10 * per_block + per_block // 2)
    assert num_blocks_for(config, backend(), NUM_LAYERS, torch.bfloat16) == 10
    # A draft model's pool of the same block count is paid from the same budget.
    assert num_blocks_for(config, backend(), NUM_LAYERS, torch.bfloat16, extra_bytes_per_block=per_block) == 5


def test_blocks_view_is_the_pool_by_block_and_refuses_other_layouts():
    caches = allocate_kv_cache(backend(torch.float32), 6, 16, NUM_LAYERS, torch.float32, "cpu")
    view = blocks_view(caches)
    assert view.shape == (6, 2 * NUM_LAYERS, 16, 2, 8)
    view[4].copy_(torch.arange(2 * NUM_LAYERS, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 16, 2, 8))
    for layer, (k, v) in enumerate(caches):
        assert (k[4] == 2 * layer).all() and (v[4] == 2 * layer + 1).all()
        assert not k[3].any() and not v[5].any()
    with pytest.raises(ValueError, match="back to back"):
        blocks_view([(v, k) for k, v in caches])  # out of order


def test_swap_space_moves_every_mirrored_pool_with_the_same_pairs():
    """The target's pool and a draft's (another shape, same block ids) go out and come back together, to other
    device blocks than they left."""
    target = allocate_kv_cache(backend(torch.float32), 6, 16, NUM_LAYERS, torch.float32, "cpu")
    draft = allocate_kv_cache(TorchRefAttentionBackend(2, 1, 8, torch.float32), 6, 16, 1, torch.float32, "cpu")
    pools = [blocks_view(target), blocks_view(draft)]
    g = torch.Generator().manual_seed(0)
    for pool in pools:
        pool.copy_(torch.randn(pool.shape, generator=g))
    before = [pool.clone() for pool in pools]
    swap = SwapSpace(3, [target, draft])
    swap.swap_out([(1, 0), (4, 2)])
    for pool in pools:
        pool.zero_()
    swap.swap_in([(5, 0), (0, 2)])
    for pool, old in zip(pools, before, strict=True):
        assert torch.equal(pool[5], old[1]) and torch.equal(pool[0], old[4])
        assert not pool[1].any() and not pool[4].any()


def test_the_default_budget_follows_the_kvcache_space_variable(monkeypatch):
    per_block = bytes_per_block(backend(), 16, NUM_LAYERS, torch.bfloat16)
    monkeypatch.setenv(KVCACHE_SPACE_ENV, "0.25")
    assert default_kv_budget() == 1 << 28
    assert num_blocks_for(CacheConfig(block_size=16), backend(), NUM_LAYERS, torch.bfloat16) == (1 << 28) // per_block
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv(KVCACHE_SPACE_ENV, bad)
        with pytest.raises(ValueError, match=KVCACHE_SPACE_ENV):
            default_kv_budget()
    monkeypatch.delenv(KVCACHE_SPACE_ENV)
    assert 0 < default_kv_budget() <= 4 << 30
