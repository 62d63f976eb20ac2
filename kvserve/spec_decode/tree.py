"""EAGLE-2 draft trees: growing one, its tree-attention mask, the walk that verifies it, and the KV moves
that keep only the accepted path.

A tree hangs below the request's last verified token (the root, not a node). Its N nodes are flattened in rank
order, best cumulative draft log-prob first (ties: the earlier-made node first). That order is topological (a child
never scores above its parent, and is made after it), and its first n nodes are the tree that a budget of n nodes
would have kept: the policy can verify a prefix, and from one verified tree learn what every smaller one would have
accepted (core/spec_policy.py). `parents[j]` is the parent node's index, -1 for the root.
Verification feeds N + 1 query tokens: the root, then node j at query index j + 1, at position
root position + depth(j); each attends to the cached context plus its own ancestors and itself
(`ancestor_mask`, passed to the attention backend as AttentionInputs.query_masks).

Nothing here runs a model: `grow_eagle2_tree` takes the draft's log-probs through a callback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DraftTree:
    tokens: np.ndarray  # [N] int64 draft tokens, topological order
    parents: np.ndarray  # [N] int64 parent node index, -1 for a child of the root
    scores: np.ndarray  # [N] float64 cumulative draft log-prob of the path root -> node

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> np.ndarray:
        """[N] int64, 1 for the root's children."""
        depths = np.zeros(len(self), dtype=np.int64)
        for j, p in enumerate(self.parents):
            depths[j] = 1 if p < 0 else depths[p] + 1
        return depths

    def positions(self, root_position: int) -> np.ndarray:
        """[N + 1] int64 positions of the verification's query tokens (root first): root position + depth."""
        return root_position + np.concatenate([[0], self.depths()])

    def ancestor_mask(self) -> np.ndarray:
        """[N + 1, N + 1] bool over the verification's query tokens (root at 0, node j at j + 1): True where
        query row may see the key of column (the root, its ancestors, itself)."""
        n = len(self)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        for j, p in enumerate(self.parents):
            mask[j + 1] = mask[p + 1]  # parent's row (the root's when p = -1); parents come first
            mask[j + 1, j + 1] = True
        return mask


# The draft's log-probs of a node's next token: over the whole vocabulary ([V], or [F, V] for F nodes), or their
# top-k already taken, (log-probs, token ids) each [k] (or [F, k]), best first, which a caller holding the logits
# on a device computes there (sample/sampler.py's TopLogProbs) instead of copying whole rows out.
LogProbs = np.ndarray | tuple[np.ndarray, np.ndarray]


def top_k_log_probs(log_probs: LogProbs, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(log-probs, token ids) [..., k] of the k best tokens, best first; full rows are cut with a stable sort (ties
    in token order), pairs pass through (their first k)."""
    if isinstance(log_probs, tuple):
        values, ids = log_probs
        return np.asarray(values, dtype=np.float64)[..., :k], np.asarray(ids, dtype=np.int64)[..., :k]
    rows = np.asarray(log_probs, dtype=np.float64)
    k = min(k, rows.shape[-1])
    # The first k of a stable descending sort, in O(V) per row: every token at or above the k-th largest value
    # (ties included, in index order), then sorted stably among themselves.
    flat = rows.reshape(-1, rows.shape[-1])
    ids = np.empty((len(flat), k), dtype=np.int64)
    for r, row in enumerate(flat):
        kth = np.partition(row, row.shape[-1] - k)[row.shape[-1] - k]
        cands = np.flatnonzero(row >= kth)
        ids[r] = cands[np.argsort(-row[cands], kind="stable")[:k]]
    values = np.take_along_axis(flat, ids, axis=1)
    return values.reshape(*rows.shape[:-1], k), ids.reshape(*rows.shape[:-1], k)


def grow_eagle2_tree(
    root_log_probs: LogProbs,
    expand: Callable[[DraftTree, np.ndarray], LogProbs],
    depth: int,
    top_k: int,
    total_nodes: int,
) -> DraftTree:
    """EAGLE-2's dynamic tree. `root_log_probs`: the draft's log-probs of the token after the root (LogProbs).
    Depth 1 takes its top_k tokens. At each further depth, the top_k nodes of the last depth by cumulative
    log-prob (the frontier) are expanded: `expand(pool, frontier)` returns each frontier node's next-token
    log-probs, one row per frontier node (the pool holds every candidate so far, so the callback can read a node's
    path), and each frontier node gets its top_k children. Finally every candidate is reranked by cumulative
    log-prob and the best `total_nodes` kept, in that rank order. A child never scores above its parent (log-probs
    <= 0) and ties keep the earlier-made node, so the kept set holds every kept node's ancestors, each before it."""
    if depth < 1 or top_k < 1 or total_nodes < 1:
        raise ValueError(f"draft tree: depth, top_k and total_nodes must be >= 1 (got {depth}, {top_k}, {total_nodes})")
    # A kept node's ancestors are kept too, so no kept node is deeper than total_nodes: levels past it would
    # cost expansions (a head forward each) for candidates the reranking must drop. The shallower levels' frontiers
    # depend on earlier levels only, so the tree is the same.
    depth = min(depth, total_nodes)
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []

    def add_children(parent: int, base: float, values: np.ndarray, ids: np.ndarray) -> list[int]:
        made = list(range(len(tokens), len(tokens) + len(ids)))
        tokens.extend(ids.tolist())
        parents.extend([parent] * len(ids))
        scores.extend((base + values).tolist())
        return made

    last = add_children(-1, 0.0, *top_k_log_probs(root_log_probs, top_k))
    for _ in range(depth - 1):
        order = sorted(last, key=lambda j: (-scores[j], j))
        frontier = np.array(order[:top_k], dtype=np.int64)
        pool = DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64), np.array(scores))
        values, ids = top_k_log_probs(expand(pool, frontier), top_k)
        assert values.shape[0] == len(frontier), (values.shape, len(frontier))
        last = [c for f, v, i in zip(frontier, values, ids, strict=True) for c in add_children(int(f), scores[f], v, i)]
    keep = sorted(range(len(tokens)), key=lambda j: (-scores[j], j))[:total_nodes]
    new_index = {old: new for new, old in enumerate(keep)}
    kept_parents = [-1 if parents[j] < 0 else new_index[parents[j]] for j in keep]
    return DraftTree(
        tokens=np.array([tokens[j] for j in keep], dtype=np.int64),
        parents=np.array(kept_parents, dtype=np.int64),
        scores=np.array([scores[j] for j in keep], dtype=np.float64),
    )


def walk_tree(tree: DraftTree, targets: np.ndarray) -> tuple[list[int], list[int]]:
    """Verification against the target's picks. `targets` [N + 1]: the token the target emits after each query
    token (root first): greedy, its argmax; sampled, its draw (worker/tree_step.py says why that is exact).
    Returns (accepted node indices root-to-leaf: the longest path whose every token equals the target's pick at
    its parent; the tokens to emit: the accepted ones, then the target's pick at the path's end)."""
    children: dict[int, list[int]] = {}
    for j, p in enumerate(tree.parents):
        children.setdefault(int(p), []).append(j)
    path: list[int] = []
    node = -1
    while True:
        want = int(targets[node + 1])
        match = next((c for c in children.get(node, []) if int(tree.tokens[c]) == want), None)
        if match is None:
            break
        path.append(match)
        node = match
    emitted = [int(tree.tokens[j]) for j in path] + [int(targets[node + 1])]
    return path, emitted


def compaction_moves(path: list[int]) -> list[tuple[int, int]]:
    """(source, destination) query indices that move the accepted path's K/V into the chain order: the node at
    depth d (query index node + 1) goes to query index d. Sources never lie below destinations, so applying the
    moves in order never reads a slot already overwritten."""
    return [(node + 1, d) for d, node in enumerate(path, 1) if node + 1 != d]


def compact_kv(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    query_slots: np.ndarray,
    path: list[int],
) -> None:
    """Apply compaction_moves to every layer's standard-layout cache ([num_blocks, block_size, ...]).
    `query_slots` [N + 1]: the slots the verification wrote its query tokens' K/V to (root first)."""
    moves = compaction_moves(path)
    if not moves:
        return
    for src, dst in moves:  # in order: see compaction_moves
        for key_cache, value_cache in kv_caches:
            for cache in (key_cache, value_cache):
                flat = cache.view(-1, *cache.shape[2:])
                flat[int(query_slots[dst])] = flat[int(query_slots[src])]
