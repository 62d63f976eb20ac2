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


AMX_ATTENTION = K.attention_amx_active()


@pytest.mark.skipif(not AMX_ATTENTION, reason="no AMX-BF16 on this CPU (or Linux refused the tile registers)")
@pytest.mark.parametrize("num_heads,num_kv_heads,hd", [(9, 3, 64), (8, 8, 64), (8, 1, 64), (16, 4, 128)])
@pytest.mark.parametrize("variant", ["plain", "window", "alibi", "tree"])
def test_amx_attention_rows_do_not_depend_on_their_group(num_heads, num_kv_heads, hd, variant):
    """The pair-packed kernel on AMX tiles (paged_attention_amx.cpp): one request's 40-token chunk (grouped 16
    tokens at a time, the last group partial; 128-dim heads in two passes), decodes of other requests and a row of
    the same request alone give each row bitwise the output it gets alone or in any other split, and agree with the
    vector kernel to bf16's precision. Where AMX is absent the vector kernel runs for everything: nothing to test."""
    from kvserve.attention.cpu_kernels import pack_kv_blocks

    torch.manual_seed(0)
    bs, num_blocks = 16, 80
    kc = torch.randn(num_blocks, bs, num_kv_heads, hd).to(torch.bfloat16)
    vc = torch.randn(num_blocks, bs, num_kv_heads, hd).to(torch.bfloat16)
    pk, pv = pack_kv_blocks(kc, vc)
    perm = torch.randperm(num_blocks).int()
    chunk = [(perm[:10], 100 + i + 1) for i in range(40)]  # positions 100..139
    decodes = [(perm[10 + 10 * j : 20 + 10 * j], 31 + 57 * j) for j in range(3)]
    rows = chunk[:25] + decodes[:2] + chunk[25:] + decodes[2:] + [chunk[7]]
    table = torch.stack([t for t, _ in rows]).contiguous()
    lens = torch.tensor([n for _, n in rows], dtype=torch.int64)
    q = torch.randn(len(rows), num_heads, hd).to(torch.bfloat16)
    window = 37 if variant == "window" else 0
    alibi = torch.rand(num_heads) * 0.2 if variant == "alibi" else None
    hidden = None
    if variant == "tree":  # the chunk's last 8 rows as a tree: each hides a few of its 8 predecessors
        words = np.zeros(len(rows), dtype=np.int64)
        words[20:25] = [0b10, 0b110, 0b1010, 0b10100, 0b1]
        hidden = torch.from_numpy(words)

    def attend(a, b):
        h = None if hidden is None else hidden[a:b].contiguous()
        return K.paged_attention_packed(
            q[a:b].contiguous(), pk, pv, table[a:b].contiguous(), lens[a:b].contiguous(), hd**-0.5, window, alibi, h
        )

    whole = attend(0, len(rows))
    for s in range(len(rows)):
        assert torch.equal(attend(s, s + 1), whole[s : s + 1]), f"row {s} alone"
    splits = [(0, 7), (7, 23), (23, 30), (30, len(rows))]
    assert torch.equal(torch.cat([attend(a, b) for a, b in splits]), whole)
    was = K.attention_amx_set_enabled(False)
    try:
        vectors = attend(0, len(rows))
    finally:
        K.attention_amx_set_enabled(was)
    torch.testing.assert_close(whole.float(), vectors.float(), atol=1e-2, rtol=1e-2)


def reference_masked(q, keys, values, scale, window, slopes, hidden):
    """reference() for a row at position len - 1 (len = keys' length) with a sliding window (0: none), ALiBi slopes
    ([H] or None) and a tree word (bit b hides the key at len - 1 - b)."""
    n, group = keys.shape[0], q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()
    v = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("hd,shd->hs", q.float(), k) * scale
    pos = torch.arange(n)
    if slopes is not None:
        scores = scores + slopes[:, None] * (pos - (n - 1))[None, :].float()
    masked = torch.zeros(n, dtype=torch.bool)
    if window:
        masked |= pos < n - window
    for b in range(64):
        if (hidden >> b) & 1 and n - 1 - b >= 0:
            masked[n - 1 - b] = True
    scores = scores.masked_fill(masked[None, :], float("-inf"))
    return torch.einsum("hs,shd->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (16, 2, 128), (6, 3, 24)])
@pytest.mark.parametrize("block_size", [16, 5, 300])
@pytest.mark.parametrize("variant", ["plain", "window", "alibi", "tree"])
def test_long_contexts_across_softmax_spans(cache_dtype, num_heads, num_kv_heads, head_dim, block_size, variant):
    """Contexts of several of the fast path's softmax spans (whole blocks, ~256 keys each; one block when a block is
    bigger), ending inside a span, at its edge and just past it: the running max and the rescale across spans,
    a window that starts in an earlier span, ALiBi, and tree words whose hidden keys straddle a span's edge."""
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    lens = [700, 256, 257, 511, 64, 1030, 300, 301]
    window = 290 if variant == "window" else 0
    slopes = torch.rand(num_heads) * 0.05 if variant == "alibi" else None
    hidden = [0] * len(lens)
    if variant == "tree":
        hidden = [int(rng.integers(1, 2**62)) << 1 for _ in lens]  # never the row's own key (bit 0)
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    # Scores that grow along the context move the running max in every span.
    k_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim) * 2).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    free = list(rng.permutation(num_blocks))
    table = np.zeros((len(lens), max(math.ceil(n / block_size) for n in lens)), dtype=np.int32)
    for i, n in enumerate(lens):
        table[i, : math.ceil(n / block_size)] = [free.pop() for _ in range(math.ceil(n / block_size))]
    q = torch.randn(len(lens), num_heads, head_dim)
    scale = head_dim**-0.5
    out = K.paged_attention_decode(
        q,
        k_cache,
        v_cache,
        torch.from_numpy(table),
        torch.tensor(lens),
        scale,
        window,
        slopes,
        torch.tensor([h - (1 << 64) if h >= 1 << 63 else h for h in hidden], dtype=torch.int64)
        if variant == "tree"
        else None,
    )
    for i, n in enumerate(lens):
        ids = torch.from_numpy(table[i]).long()
        keys = k_cache[ids].float().reshape(-1, num_kv_heads, head_dim)[:n]
        values = v_cache[ids].float().reshape(-1, num_kv_heads, head_dim)[:n]
        expected = reference_masked(q[i], keys, values, scale, window, slopes, hidden[i])
        torch.testing.assert_close(out[i], expected, atol=3e-5, rtol=3e-5)
