"""The Triton kernels with an fp8 KV cache: the write kernel stores what kv_dtype.quantize_kv stores, byte for
byte, and attention equals exact attention over the dequantized K/V and the torch reference backend's output over
the same fp8 cache. On the GPU when there is one, else in Triton's interpreter (as test_triton_attention.py)."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.kv_dtype import quantize_kv
from kvserve.attention.torch_ref import TorchRefAttentionBackend

pytest.importorskip("triton")

from kvserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tests.attention.test_triton_attention import (  # noqa: E402
    DEVICE,
    MIXED,
    TOL,
    make_batch,
    pytestmark,  # noqa: F401  (the same skip on forced ISA levels)
    reference_attention,
    run_backend,
)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_matches_dequantized_reference_and_torch_backend(cache_dtype, dtype):
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=5)
    batch.k_new[0, 0, :3] = torch.tensor([float("nan"), 1e6, -1e6], dtype=dtype)  # saturate, NaN -> 0
    batch.key_cache = quantize_kv(batch.key_cache * 3, cache_dtype)  # a wider spread: subnormals and rounding
    batch.value_cache = quantize_kv(batch.value_cache, cache_dtype)
    ref_cache = (batch.key_cache.cpu().clone(), batch.value_cache.cpu().clone())
    # The cached contexts as the cache holds them (the first tokens of each request were written above, x3 for K).
    qsl, num_new = batch.inputs.query_start_loc, []
    keys, values = [], []
    flat_k = batch.key_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)
    flat_v = batch.value_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)
    table, bs = batch.inputs.block_table, block_size
    for i, seq_len in enumerate(batch.inputs.seq_lens):
        n = int(qsl[i + 1] - qsl[i])
        num_new.append(n)
        ctx_slots = [int(table[i, p // bs]) * bs + p % bs for p in range(int(seq_len) - n)]
        ctx_k = flat_k[ctx_slots].view(cache_dtype).to(dtype)
        ctx_v = flat_v[ctx_slots].view(cache_dtype).to(dtype)
        new_k = quantize_kv(batch.k_new[qsl[i] : qsl[i + 1]], cache_dtype).to(dtype)
        new_v = quantize_kv(batch.v_new[qsl[i] : qsl[i + 1]], cache_dtype).to(dtype)
        keys.append(torch.cat([ctx_k, new_k]))
        values.append(torch.cat([ctx_v, new_v]))

    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, DEVICE, kv_cache_dtype=cache_dtype)
    out = run_backend(backend, batch)
    for i in range(len(keys)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        want = reference_attention(batch.q[s:e], keys[i], values[i], head_dim**-0.5)
        got = out[s:e].view(e - s, num_heads, head_dim).float()
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype], msg=f"request {i}")
    slots = torch.from_numpy(batch.slots).to(batch.key_cache.device)
    written_k = batch.key_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)[slots]
    written_v = batch.value_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)[slots]
    assert torch.equal(written_k, quantize_kv(batch.k_new, cache_dtype).view(torch.uint8))
    assert torch.equal(written_v, quantize_kv(batch.v_new, cache_dtype).view(torch.uint8))

    ref = TorchRefAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, cache_dtype)
    want = ref.forward(
        batch.q.cpu(), batch.k_new.cpu(), batch.v_new.cpu(), ref_cache, ref.build_metadata(batch.inputs), 64**-0.5
    )
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(batch.key_cache.cpu().view(torch.uint8), ref_cache[0].view(torch.uint8))
    assert torch.equal(batch.value_cache.cpu().view(torch.uint8), ref_cache[1].view(torch.uint8))
