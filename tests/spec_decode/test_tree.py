"""EAGLE-2 draft trees (kvserve/spec_decode/tree.py): growth, the ancestor mask, the walk, KV compaction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.spec_decode.tree import (
    DraftTree,
    compact_kv,
    compaction_moves,
    grow_eagle2_tree,
    top_k_log_probs,
    walk_tree,
)


def test_grow_hand_example_exact():
    """Depth 3, top_k 2, 4 nodes kept, over a 5-token vocabulary with made-up draft probabilities."""
    lp = np.log
    root = lp([0.05, 0.6, 0.25, 0.05, 0.05])  # depth 1: token 1 (0.6), token 2 (0.25)
    nexts = {
        (1,): lp([0.7, 0.05, 0.05, 0.1, 0.1]),  # 1 -> 0 (0.42), 1 -> 3 or 4 (0.06; stable order takes 3)
        (2,): lp([0.02, 0.02, 0.02, 0.04, 0.9]),  # 2 -> 4 (0.225), 2 -> 3 (0.01)
        (1, 0): lp([0.1, 0.1, 0.5, 0.2, 0.1]),  # 1 0 -> 2 (0.21), 1 0 -> 3 (0.084)
        (2, 4): lp([0.8, 0.05, 0.05, 0.05, 0.05]),  # 2 4 -> 0 (0.18), then 0.01125
    }
    calls = []

    def expand(pool: DraftTree, frontier: np.ndarray) -> np.ndarray:
        out = []
        for f in frontier:
            path, j = [], int(f)
            while j >= 0:
                path.append(int(pool.tokens[j]))
                j = int(pool.parents[j])
            calls.append(tuple(reversed(path)))
            out.append(nexts[tuple(reversed(path))])
        return np.stack(out)

    tree = grow_eagle2_tree(root, expand, depth=3, top_k=2, total_nodes=4)
    # Depth 2's frontier is both depth-1 nodes; depth 3's is the best two of the four depth-2 nodes: (1,0) and (2,4).
    assert calls == [(1,), (2,), (1, 0), (2, 4)]
    # Best four of all, in rank order (which is topological): 1 (0.6), 1-0 (0.42), 2 (0.25), 2-4 (0.225).
    assert tree.tokens.tolist() == [1, 0, 2, 4]
    assert tree.parents.tolist() == [-1, 0, -1, 2]
    np.testing.assert_allclose(np.exp(tree.scores), [0.6, 0.42, 0.25, 0.225])
    assert tree.depths().tolist() == [1, 2, 1, 2]
    assert tree.positions(10).tolist() == [10, 11, 12, 11, 12]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("depth,top_k,total", [(1, 3, 2), (4, 2, 7), (5, 4, 16), (3, 3, 100)])
def test_grow_random_is_the_best_ancestor_closed_set(seed, depth, top_k, total):
    rng = np.random.default_rng(seed)
    vocab = 12

    def dist():
        x = rng.random(vocab) ** 3
        return np.log(x / x.sum())

    pools = []

    def expand(pool, frontier):
        pools.append(pool)
        return np.stack([dist() for _ in frontier])

    state = rng.bit_generator.state
    tree = grow_eagle2_tree(dist(), expand, depth, top_k, total)
    assert len(pools) == depth - 1
    assert all(np.diff(tree.scores) <= 0)  # rank order
    pool_size = top_k + (depth - 1) * top_k * top_k  # the root's top_k, then top_k children of top_k per depth
    assert len(tree) == min(total, pool_size)
    for j, p in enumerate(tree.parents):
        assert p < j  # topological
        if p >= 0:
            assert tree.scores[p] >= tree.scores[j]
    assert tree.depths().max() <= depth
    # Siblings are distinct tokens (a top-k of one distribution).
    for p in set(tree.parents.tolist()):
        sib = tree.tokens[tree.parents == p]
        assert len(set(sib.tolist())) == len(sib)
    if pools:  # every candidate made before the last depth that was not kept scores no better than the kept
        made = pools[-1].scores
        kept = set(np.round(tree.scores, 12).tolist())
        dropped = [x for x in made if round(x, 12) not in kept]
        assert not dropped or max(dropped) <= tree.scores.min() + 1e-12
    # Its first n nodes are the tree that a budget of n grows from the same draws (the expansions do not depend on
    # the budget while it reaches every level).
    for n in range(depth, len(tree)):
        rng.bit_generator.state = state
        small = grow_eagle2_tree(dist(), expand, depth, top_k, n)
        for field in ("tokens", "parents", "scores"):
            np.testing.assert_array_equal(getattr(small, field), getattr(tree, field)[:n])


def test_grow_from_top_k_pairs_equals_grow_from_rows():
    """A caller may hand over each row's top-k (log-probs, ids) instead of the whole row (eagle_tree.py takes
    them with torch.topk): the same tree, and a row's top-k is a stable sort's (ties in token order)."""
    rng = np.random.default_rng(3)
    rows = {}

    def row(key):
        if key not in rows:
            x = rng.random(20) ** 3
            x[rng.integers(20, size=3)] = x.max()  # ties at the top
            rows[key] = np.log(x / x.sum())
        return rows[key]

    def path(pool, j):
        out = []
        while j >= 0:
            out.append(int(pool.tokens[j]))
            j = int(pool.parents[j])
        return tuple(reversed(out))

    full = grow_eagle2_tree(row(()), lambda pool, f: np.stack([row(path(pool, j)) for j in f]), 4, 3, 10)
    pairs = grow_eagle2_tree(
        top_k_log_probs(row(()), 3),
        lambda pool, f: top_k_log_probs(np.stack([row(path(pool, j)) for j in f]), 3),
        4,
        3,
        10,
    )
    for field in ("tokens", "parents", "scores"):
        np.testing.assert_array_equal(getattr(full, field), getattr(pairs, field))
    values, ids = top_k_log_probs(row(()), 3)
    order = sorted(range(20), key=lambda t: (-row(())[t], t))[:3]
    assert ids.tolist() == order and values.tolist() == row(())[order].tolist()


def test_ancestor_mask_exact():
    tree = DraftTree(np.array([5, 6, 7, 8]), np.array([-1, -1, 0, 2]), np.zeros(4))
    expected = np.array(
        [
            [1, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0],  # node 0
            [1, 0, 1, 0, 0],  # node 1: not its sibling
            [1, 1, 0, 1, 0],  # node 2 under 0
            [1, 1, 0, 1, 1],  # node 3 under 2
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(tree.ancestor_mask(), expected)


def test_walk_tree():
    # root -> {10 (n0), 11 (n1)}; n0 -> {20 (n2), 21 (n3)}; n1 -> {22 (n4)}; n3 -> {30 (n5)}
    tree = DraftTree(np.array([10, 11, 20, 21, 22, 30]), np.array([-1, -1, 0, 0, 1, 3]), np.zeros(6))
    # target argmax at: root, n0..n5
    assert walk_tree(tree, np.array([10, 21, 0, 0, 30, 0, 99])) == ([0, 3, 5], [10, 21, 30, 99])
    assert walk_tree(tree, np.array([11, 0, 7, 0, 0, 0, 0])) == ([1], [11, 7])  # second root child, then bonus
    assert walk_tree(tree, np.array([11, 0, 22, 0, 0, 4, 0])) == ([1, 4], [11, 22, 4])
    assert walk_tree(tree, np.array([9, 21, 0, 0, 0, 30, 99])) == ([], [9])  # nothing accepted: the bonus only


def test_compaction_moves_accepted_path_into_chain_slots():
    assert compaction_moves([0, 1, 2]) == []  # already where a chain puts them
    assert compaction_moves([1, 4]) == [(2, 1), (5, 2)]
    # Two layers; the query tokens' slots are scattered over blocks, as in a paged cache.
    block_size, hkv, hd = 4, 2, 3
    caches = [(torch.randn(6, block_size, hkv, hd), torch.randn(6, block_size, hkv, hd)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    slots = np.array([22, 23, 8, 9, 10, 11, 4])  # root, n0..n5
    compact_kv(caches, slots, [1, 4])
    for (k0, v0), (k1, v1) in zip(before, caches, strict=True):
        for c0, c1 in ((k0, k1), (v0, v1)):
            f0, f1 = c0.view(-1, hkv, hd), c1.view(-1, hkv, hd)
            torch.testing.assert_close(f1[23], f0[8])  # node 1 -> depth 1
            torch.testing.assert_close(f1[8], f0[11])  # node 4 -> depth 2
            untouched = [s for s in range(f0.shape[0]) if s not in (23, 8)]
            torch.testing.assert_close(f1[untouched], f0[untouched])


def test_grow_rejects_bad_options():
    with pytest.raises(ValueError, match="depth, top_k and total_nodes"):
        grow_eagle2_tree(np.zeros(4), lambda pool, f: np.zeros((len(f), 4)), 0, 2, 4)
