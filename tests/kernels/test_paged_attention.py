"""The paged-attention kernels alone (no backend around them) against plain attention, for every shape class:
the vectorised fast path (head_dim 64/128 with the listed GQA groups) and the plain loops (anything else)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.kernels.build import require_kernels

K = require_kernels()


def reference(q, keys, values, scale):
    """q [H, D] attends over keys/values [S, Hkv, D]."""
    group = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()
    v = values.repeat_interleave(group, dim=1).float()
    probs = (torch.einsum("hd,shd->hs", q.float(), k) * scale).softmax(-1)
    return torch.einsum("hs,shd->hd", probs, v)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(9, 3, 64), (8, 8, 64), (16, 2, 128), (8, 1, 64), (6, 3, 24), (4, 2, 40)],
)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("num_seqs", [1, 9])  # one task per kv head, or whole rows per task
def test_decode_kernel_matches_reference(dtype, atol, num_heads, num_kv_heads, head_dim, block_size, num_seqs):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    lens = [int(x) for x in rng.integers(1, 70, num_seqs)]
    lens[0] = 67  # partial last block, several tiles
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    free = list(rng.permutation(num_blocks))
    table = np.zeros((num_seqs, max(math.ceil(n / block_size) for n in lens)), dtype=np.int32)
    for i, n in enumerate(lens):
        table[i, : math.ceil(n / block_size)] = [free.pop() for _ in range(math.ceil(n / block_size))]
    q = torch.randn(num_seqs, num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = K.paged_attention_decode(q, k_cache, v_cache, torch.from_numpy(table), torch.tensor(lens), scale)
    for i, n in enumerate(lens):
        ids = torch.from_numpy(table[i]).long()
        keys = k_cache[ids].reshape(-1, num_kv_heads, head_dim)[:n]
        values = v_cache[ids].reshape(-1, num_kv_heads, head_dim)[:n]
        torch.testing.assert_close(out[i].float(), reference(q[i], keys, values, scale), atol=atol, rtol=atol)
