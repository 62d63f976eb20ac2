"""Tree attention (AttentionInputs.query_masks): each draft-tree token sees the request's cached context plus its own
ancestors, in both CPU backends, beside ordinary decodes and prefill chunks of the same step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvserve.attention.base import AttentionInputs
from kvserve.spec_decode.tree import DraftTree
from tests.attention.test_backends import make_backend, reference_attention, uses_packed_layout


def path_to(parents: np.ndarray, j: int) -> list[int]:
    """Query indices of the root, node j's ancestors and node j, in order (independent of DraftTree)."""
    path = []
    while j >= 0:
        path.append(j + 1)
        j = int(parents[j])
    return [0, *reversed(path)]


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (3, 3, 32)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_tree_tokens_see_context_and_ancestors_only(use_kernel, num_heads, num_kv_heads, head_dim, block_size):
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    dtype = torch.float32
    # A 9-node tree: two children of the root, a chain under the first, siblings under the second.
    parents = np.array([-1, -1, 0, 0, 1, 2, 2, 5, 4])
    tree = DraftTree(np.arange(9), parents, np.zeros(9))
    n_q = len(parents) + 1
    # (cached context, query tokens, query mask): a decode, the tree request, a plain chunk, a tree with no context.
    seqs = [(11, 1, None), (37, n_q, tree.ancestor_mask()), (5, 6, None), (0, n_q, tree.ancestor_mask())]
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n, _ in seqs) + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    free = list(rng.permutation(num_blocks))
    max_blocks = max(math.ceil((c + n) / block_size) for c, n, _ in seqs)
    block_table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    full_k, full_v, slots = [], [], []
    for i, (ctx, n, _) in enumerate(seqs):
        nb = math.ceil((ctx + n) / block_size)
        block_table[i, :nb] = [free.pop() for _ in range(nb)]
        full_k.append(torch.randn(ctx + n, num_kv_heads, head_dim))
        full_v.append(torch.randn(ctx + n, num_kv_heads, head_dim))
        for pos in range(ctx + n):
            slot = int(block_table[i, pos // block_size]) * block_size + pos % block_size
            if pos < ctx:
                key_cache.view(-1, num_kv_heads, head_dim)[slot] = full_k[i][pos]
                value_cache.view(-1, num_kv_heads, head_dim)[slot] = full_v[i][pos]
            else:
                slots.append(slot)
    qsl = np.concatenate([[0], np.cumsum([n for _, n, _ in seqs])])
    inputs = AttentionInputs(
        num_decodes=1,
        query_start_loc=qsl,
        seq_lens=np.array([c + n for c, n, _ in seqs]),
        block_table=block_table,
        slot_mapping=np.array(slots, dtype=np.int64),
        block_size=block_size,
        query_masks={i: m for i, (_, _, m) in enumerate(seqs) if m is not None},
    )
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, dtype=dtype)
    k_new = torch.cat([full_k[i][c:] for i, (c, _, _) in enumerate(seqs)])
    v_new = torch.cat([full_v[i][c:] for i, (c, _, _) in enumerate(seqs)])
    backend = make_backend(use_kernel, num_heads, num_kv_heads, head_dim, dtype)
    assert not uses_packed_layout(backend, block_size)  # fp32: the standard layout
    scale = head_dim**-0.5
    out = backend.forward(q, k_new, v_new, (key_cache, value_cache), backend.build_metadata(inputs), scale)
    out = out.view(-1, num_heads, head_dim)

    for i, (ctx, n, mask) in enumerate(seqs):
        s = int(qsl[i])
        if mask is None:  # plain causal rows are untouched by the other requests' trees
            ref = reference_attention(q[s : s + n], full_k[i], full_v[i], scale)
            torch.testing.assert_close(out[s : s + n], ref, atol=1e-5, rtol=1e-5)
            continue
        # Each tree token equals the last token of a causal chain: the context, then its root path.
        for j in range(n):
            keep = list(range(ctx)) + [ctx + a for a in path_to(parents, j - 1)] if j else list(range(ctx + 1))
            ref = reference_attention(q[s + j : s + j + 1], full_k[i][keep], full_v[i][keep], scale)
            torch.testing.assert_close(out[s + j : s + j + 1], ref, atol=1e-5, rtol=1e-5)
