import threading

import torch

from kvserve.config import ArchConfig
from kvserve.worker.kv_cache import allocate_kv_cache, prefault_kv_cache

ARCH = ArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=128,
)


def test_fresh_cache_is_zero_and_prefault_keeps_contents():
    caches = allocate_kv_cache(200, 16, ARCH, torch.bfloat16)
    assert len(caches) == 3 and caches[0][0].shape == (200, 16, 2, 8)
    assert all(not t.any() for kv in caches for t in kv)
    caches[1][1][7] = 3.5  # written "by the engine" before the pages are populated
    caches[2][0][199, 15] = -1.0
    prefault_kv_cache(caches)  # False on kernels without MADV_POPULATE_WRITE; contents must not change either way
    assert (caches[1][1][7] == 3.5).all() and (caches[2][0][199, 15] == -1.0).all()
    assert int((caches[1][1] != 0).sum()) == 16 * 2 * 8 and int((caches[2][0] != 0).sum()) == 2 * 8
    assert not caches[0][0].any() and not caches[0][1].any()


def test_prefault_stops_when_asked():
    caches = allocate_kv_cache(64, 16, ARCH, torch.float32)
    stop = threading.Event()
    stop.set()
    assert prefault_kv_cache(caches, stop) is False
