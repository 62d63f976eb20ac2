"""The runner's side of EAGLE-2 draft trees: laying a tree's verification out in a step, and turning the verified
step into the chain of its accepted path.

Layout: a request verifying a tree of N nodes is scheduled like a chain of N drafts (the nodes' tokens follow its
known tokens in its row, its query is the root and the N nodes, in N + 1 consecutive KV slots), but the model
sees node j at RoPE position root + depth(j) and through the tree's ancestor mask (AttentionInputs.query_masks).

After the forward pass, `draw_tree_targets` draws at every tree row what the rejection sampler would draw there
(greedy: the argmax; sampled: the keyed Gumbel draw from the target's distribution at the node), and `walk_trees`
follows the children that equal those draws (spec_decode/tree.py), moves the accepted path's K/V into the chain
order (the node at depth d to slot root + d), and rewrites the step as if the request had verified the path as a
chain: its logits rows, its drafts in the row, its hidden rows for the proposer, and the noise keys drawn with.
The rejection sampler then verifies that chain of one-hot drafts as usual, with the same keys: it draws the same
tokens and accepts the whole path, so logprobs, penalties and seeds behave as with chains.

Why sampling stays exact (EAGLE-2's multi-candidate rule in its one-hot form): the rejection sampler emits, at
each position, its draw y_d from the target's distribution at the context so far, whatever the draft there was
(an accepted draft equals y_d, a rejected one is replaced by it). The path's node at depth d + 1 is chosen from
the draw at depth d only, never from the noise of its own position, so each y_d is a fresh draw given the tokens
before it. With the same keys the walk's draw is the sampler's, so a position is accepted with probability
p(any child), not p(the argmax child). (A request with penalties scores a tree node with the penalty history of
the first nodes in topological order rather than its ancestors: its walk can then choose a path the sampler
rejects, which costs acceptance, never exactness.) The rest of the tree's slots are past the request's computed
tokens: later steps overwrite them, as a chain's rejected drafts'.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from kvserve.attention.base import AttentionBackend, KVCache
from kvserve.sample.rejection_sampler import RejectionSampler
from kvserve.sample.sampler import Sampler, SamplingMetadata
from kvserve.spec_decode.tree import DraftTree, compaction_moves, walk_tree
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.sampling_inputs import build_sampling_metadata
from kvserve.worker.step_inputs import StepInputs


def apply_tree_layout(step: StepInputs, parents: dict[str, np.ndarray], backend: AttentionBackend) -> StepInputs:
    """The step with its tree requests' RoPE positions and ancestor masks (and metadata built for them);
    `parents`: each request's proposed tree's parents. A request verifies the first num_drafts nodes it was
    scheduled (a prefix of a topological order is a tree). `step` itself when no request verifies a tree."""
    trees: dict[int, DraftTree] = {}
    for i, req_id in enumerate(step.req_ids):
        n = int(step.num_drafts[i])
        if n and req_id in parents:
            end = int(step.query_start_loc[i + 1])
            tokens = step.input_ids[end - n : end].astype(np.int64)
            trees[i] = DraftTree(tokens, parents[req_id][:n], np.zeros(n))
    if not trees:
        return step
    assert step.graph_size is None, "draft trees run eagerly (no decode graph has a query of more than one token)"
    model_positions = step.positions.copy()
    masks = {}
    for i, tree in trees.items():
        end = int(step.query_start_loc[i + 1])
        root = end - len(tree) - 1
        model_positions[root:end] = tree.positions(int(step.positions[root]))
        masks[i] = tree.ancestor_mask()
    attn_inputs = replace(step.attn_inputs, query_masks=masks)
    return replace(
        step,
        attn_inputs=attn_inputs,
        attn_metadata=backend.build_metadata(attn_inputs),
        model_positions=model_positions,
        trees=trees,
    )


def _scored_rows(step: StepInputs, num_logits: np.ndarray) -> tuple[np.ndarray, dict[int, int]]:
    """Each sampling request's first logits row, and step request index -> its sampling index."""
    return np.cumsum(num_logits) - num_logits, {int(i): j for j, i in enumerate(step.sample_idx.tolist())}


def draw_tree_targets(
    step: StepInputs,
    logits: torch.Tensor,  # [sum(num_logits), V] the scored rows (tree requests: the root and every node)
    num_logits: np.ndarray,  # [S] per sampling request
    batch: InputBatch,
    rejection_sampler: RejectionSampler,
    vocab_size: int,
    generator: torch.Generator,
) -> tuple[np.ndarray, torch.Tensor | None]:
    """The rejection sampler's draw at every tree row (tree by tree in step order, root then nodes; a node's row
    samples the token after it, at position root + depth + 1) and the rows' noise keys (None when all greedy).
    Call before `walk_trees`, which writes the path into the batch rows this reads."""
    assert step.trees is not None
    first_row, where = _scored_rows(step, num_logits)
    rows, states, offsets = [], [], []
    for i, tree in step.trees.items():
        rows.append(first_row[where[i]] + np.arange(len(tree) + 1))
        states += [step.states[i]] * (len(tree) + 1)
        offsets.append(np.concatenate([[0], tree.depths()]))
    md = build_sampling_metadata(states, batch, vocab_size, generator, np.concatenate(offsets), device=logits.device)
    draw = rejection_sampler.draw_targets(logits[torch.from_numpy(np.concatenate(rows)).to(logits.device)], md)
    return draw.target.cpu().numpy(), None if draw.keys is None else draw.keys.cpu()


def with_tree_keys(md: SamplingMetadata, num_rows: int, tree_keys: tuple[np.ndarray, torch.Tensor]) -> SamplingMetadata:
    """`md` (for the walked step's `num_rows` scored rows) with its noise keys fixed: the trees' rows get the keys
    their walk drew with, the others fresh ones as usual."""
    rows, keys = tree_keys
    all_keys = Sampler.draw_keys(md, num_rows)
    all_keys[torch.from_numpy(rows)] = keys
    return replace(md, keys=all_keys)


def walk_trees(
    step: StepInputs,
    logits: torch.Tensor,  # [sum(num_logits), V] the scored rows (tree requests: the root and every node)
    num_logits: np.ndarray,  # [S] per sampling request
    hidden: torch.Tensor,  # [T, hidden]
    batch: InputBatch,
    kv_caches: list[KVCache],
    backend: AttentionBackend,
    targets: np.ndarray,  # draw_tree_targets' draws
    keys: torch.Tensor | None,  # and their keys
) -> tuple[torch.Tensor, np.ndarray, StepInputs, torch.Tensor]:
    """Walk each tree on `targets`, compact its accepted path's K/V, and return the step as chains: (logits rows,
    num_logits, step, hidden) where a tree request has the root's and its path's rows only, the path's tokens as
    its drafts (written after its known tokens in `batch`), its computed count moved back past the rest of the
    tree, and its hidden rows and input ids in chain order (the proposer mirrors a chain); the step's tree_keys
    hold the keys of the kept tree rows. No masks nor tree positions remain in the returned step (the proposer
    builds its own metadata from its inputs)."""
    assert step.trees is not None
    qsl = step.query_start_loc
    first_row, where = _scored_rows(step, num_logits)
    row_keep = [np.arange(int(first_row[j]), int(first_row[j] + num_logits[j])) for j in range(len(num_logits))]
    new_num_logits = num_logits.copy()
    token_perm = np.arange(len(step.input_ids))
    src_slots, dst_slots = [], []
    key_rows: dict[int, np.ndarray] = {}  # sampling request -> the kept rows' indices among the tree rows
    done = 0
    for i, tree in step.trees.items():
        j = where[i]
        path, _ = walk_tree(tree, targets[done : done + len(tree) + 1])
        kept = np.array([0] + [p + 1 for p in path], dtype=np.int64)
        key_rows[j] = done + kept
        done += len(tree) + 1
        row_keep[j] = first_row[j] + kept
        new_num_logits[j] = len(path) + 1
        root = int(qsl[i + 1]) - len(tree) - 1
        moves = compaction_moves(path)
        src_slots += [step.attn_inputs.slot_mapping[root + s] for s, _ in moves]
        dst_slots += [step.attn_inputs.slot_mapping[root + d] for _, d in moves]
        order = [0] + [p + 1 for p in path]
        order += [q for q in range(len(tree) + 1) if q not in set(order)]
        token_perm[root : root + len(tree) + 1] = root + np.array(order)
        row = int(step.rows[i])
        start = int(batch.num_tokens[row])
        batch.token_ids[row, start : start + len(path)] = tree.tokens[path]
        batch.num_computed_tokens[row] -= len(tree) - len(path)
    backend.move_kv_slots(
        kv_caches, np.array(src_slots, dtype=np.int64), np.array(dst_slots, dtype=np.int64), step.attn_inputs.block_size
    )
    keep = torch.from_numpy(np.concatenate(row_keep)).to(logits.device)
    perm = torch.from_numpy(token_perm).to(hidden.device)
    chain_step = replace(
        step,
        input_ids=step.input_ids[token_perm],
        attn_inputs=replace(step.attn_inputs, query_masks=None),
        attn_metadata=None,
        model_positions=None,
        trees=None,
        num_drafts=step.num_drafts.copy(),
    )
    for i in step.trees:
        chain_step.num_drafts[i] = new_num_logits[where[i]] - 1
    if keys is not None:
        new_first = np.cumsum(new_num_logits) - new_num_logits
        rows = np.concatenate([new_first[j] + np.arange(new_num_logits[j]) for j in key_rows])
        chain_step.tree_keys = (rows, keys[torch.from_numpy(np.concatenate(list(key_rows.values())))])
    return logits[keep], new_num_logits, chain_step, hidden[perm]
