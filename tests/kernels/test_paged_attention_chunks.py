"""The paged-attention kernel's tile path (kernels/csrc/paged_attention_chunk.cpp): runs of rows that are one
request's chunk, given as `chunks`, against plain attention, mixed with rows outside any chunk."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.kernels.build import require_kernels
from tests.kernels.test_paged_attention import reference

K = require_kernels()
# The tile path runs on AVX2 and AVX-512 only; elsewhere the kernel takes every row by itself (same results).
TILES = K.vector_isa() in ("avx2", "avx512")
LANES = 32 if K.vector_isa() == "avx512" else 16


def make_batch(requests, num_kv_heads, head_dim, block_size, cache_dtype, seed=0):
    """requests: (keys before the step, query tokens) each. Returns the kernel's inputs and the chunks of the
    requests with more than one query token."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    nblocks = [math.ceil((ctx + n) / block_size) for ctx, n in requests]
    num_blocks = sum(nblocks) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    if cache_dtype != torch.float32:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    free = list(rng.permutation(num_blocks))
    tables, lens, chunks, rows = [], [], [], 0
    for (ctx, n), nb in zip(requests, nblocks, strict=True):
        table = np.zeros(max(nblocks), dtype=np.int32)
        table[:nb] = [free.pop() for _ in range(nb)]
        if n > 1:
            chunks.append((rows, n))
        for i in range(n):
            tables.append(table)
            lens.append(ctx + i + 1)
        rows += n
    table_t = torch.from_numpy(np.stack(tables))
    return k_cache, v_cache, table_t, torch.tensor(lens), torch.tensor(chunks, dtype=torch.int64).view(-1, 2)


def check_against_reference(q, out, k_cache, v_cache, table, lens, scale, atol):
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for r in range(q.shape[0]):
        ids = table[r].long()
        keys = k_cache[ids].float().reshape(-1, num_kv_heads, head_dim)[: int(lens[r])]
        values = v_cache[ids].float().reshape(-1, num_kv_heads, head_dim)[: int(lens[r])]
        torch.testing.assert_close(out[r], reference(q[r], keys, values, scale), atol=atol, rtol=atol)


# Decode rows, a chunk from position 0, one after a 100-key context (past a 64-key softmax span, partial blocks),
# a chunk longer than a tile, a decode between chunks, a 1-token "chunk" that stays a row, a chunk at the end.
REQUESTS = [(20, 1), (0, 37), (100, 40), (7, 1), (3, 70), (50, 1), (0, 17)]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (16, 2, 128), (8, 1, 64), (6, 3, 24)]
)
@pytest.mark.parametrize("block_size", [16, 5])
def test_chunks_match_reference(cache_dtype, num_heads, num_kv_heads, head_dim, block_size):
    k_cache, v_cache, table, lens, chunks = make_batch(REQUESTS, num_kv_heads, head_dim, block_size, cache_dtype)
    q = torch.randn(len(lens), num_heads, head_dim)
    scale = head_dim**-0.5
    out = K.paged_attention_decode(q, k_cache, v_cache, table, lens, scale, chunks=chunks)
    check_against_reference(q, out, k_cache, v_cache, table, lens, scale, atol=2e-5)
    rows = K.paged_attention_decode(q, k_cache, v_cache, table, lens, scale)
    chunk_rows = torch.cat([torch.arange(f, f + n) for f, n in chunks.tolist()])
    others = torch.ones(len(lens), dtype=torch.bool)
    others[chunk_rows] = False
    # Rows outside the chunks run the row walk either way: the same bits.
    assert torch.equal(out[others], rows[others])
    if TILES and head_dim in (64, 128) and num_heads // num_kv_heads <= LANES:
        # The tiles sum in another order than the rows: proof that they ran.
        assert not torch.equal(out[chunk_rows], rows[chunk_rows])


def test_chunks_are_ignored_where_the_tiles_do_not_apply():
    """A window, ALiBi slopes or bf16 queries: every row by itself, bitwise the kernel without chunks."""
    k_cache, v_cache, table, lens, chunks = make_batch(REQUESTS, 3, 64, 16, torch.float32)
    q = torch.randn(len(lens), 9, 64)
    for kwargs in ({"window": 24}, {"alibi_slopes": torch.rand(9)}):
        with_chunks = K.paged_attention_decode(q, k_cache, v_cache, table, lens, 0.125, chunks=chunks, **kwargs)
        assert torch.equal(with_chunks, K.paged_attention_decode(q, k_cache, v_cache, table, lens, 0.125, **kwargs))
    qb, kb, vb = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    with_chunks = K.paged_attention_decode(qb, kb, vb, table, lens, 0.125, chunks=chunks)
    assert torch.equal(with_chunks, K.paged_attention_decode(qb, kb, vb, table, lens, 0.125))


@pytest.mark.skipif(not TILES, reason="the tile path runs on AVX2 and AVX-512 only")
def test_bad_chunks_are_refused():
    k_cache, v_cache, table, lens, chunks = make_batch(REQUESTS, 3, 64, 16, torch.float32)
    q = torch.randn(len(lens), 9, 64)
    first, n = chunks[1].tolist()  # the request with a 100-key context
    bad = {
        "overlap": torch.tensor([[first, n], [first + 1, 2]]),
        "past the end": torch.tensor([[len(lens) - 2, 5]]),
        "two requests": torch.tensor([[first, n + 1]]),  # runs into the next request's row
        "not consecutive": torch.tensor([[first - 1, 3]]),  # a decode row (20 keys) then the chunk's first
    }
    for name, c in bad.items():
        with pytest.raises(RuntimeError, match="chunks"):
            K.paged_attention_decode(q, k_cache, v_cache, table, lens, 0.125, chunks=c)
            pytest.fail(name)
