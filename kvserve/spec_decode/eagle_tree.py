"""EAGLE-2 draft trees from the EAGLE head: one tree per request, grown with spec_decode/tree.py's
grow_eagle2_tree, the head's log-probs computed here.

After the mirror pass (model_proposer.py: the head runs over the target's step positions), the head's row at a
request's last accepted position gives the root's children's log-probs and the root's predicted feature. Each
expansion then runs the head once over the frontier nodes *and their ancestors* (at most tree_topk per level),
as one query with the tree's ancestor mask: a node at depth d is fed at head position root + d - 1 (EAGLE's
shift: position i takes token i + 1) with its parent's predicted feature (the root's for depth 1), and sees the
request's context and its own ancestors only. Recomputing the ancestors keeps the head's KV of a query a
contiguous run of slots past the root (root .. root + closure - 1), within the scheduler's lookahead
(SpeculativeConfig.num_lookahead_slots); their outputs equal the earlier expansions' (same inputs, same visible
keys). Those slots are past the request's computed tokens, so later steps overwrite them, as the chain's.

Requests are grown one after another (each expansion is one head forward per request), each to the depth the
speculation policy gave it (DraftStepInputs.max_depths); a request with too few slots for the full depth grows a
shallower tree. A constrained request (structured outputs) grows its tree as any
other: the scheduler masks each node's row by its path (structured_output/matcher.py), so a node the grammar
refuses is never accepted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.attention.base import AttentionInputs
from kvserve.spec_decode.base import DraftProposal, DraftStepInputs
from kvserve.spec_decode.tree import DraftTree, grow_eagle2_tree

if TYPE_CHECKING:
    from kvserve.spec_decode.eagle import EagleProposer


def propose_trees(proposer: EagleProposer, step: DraftStepInputs, depth: int, top_k: int) -> DraftProposal:
    """A tree per request of `step.sample_idx` with at most min(max_drafts, K) nodes: its tokens (full ids,
    topological order) as the drafts, and its parents in `DraftProposal.parents`."""
    batch = step.batch
    idx = step.sample_idx
    rows = step.rows[idx]
    num_s = len(idx)
    next_pos = batch.num_computed_tokens[rows].astype(np.int64)  # [S] the root's position (not yet in KV)
    start_pos = step.positions[step.query_start_loc[:-1][idx]]
    last_rows = step.query_start_loc[:-1][idx] + (next_pos - 1 - start_pos)
    capacity = np.minimum(batch.num_blocks[rows] * proposer.block_size, proposer.max_model_len)
    logits, features = proposer.mirror(step, last_rows)
    if not num_s:
        return DraftProposal([], [], num_pass_requests=len(step.rows))
    assert logits is not None and features is not None
    root_values, root_ids = _top_log_probs(proposer, logits, top_k)  # [S, top_k] (draft vocabulary columns if set)
    limits = np.minimum(step.max_drafts, proposer.k)
    depths = np.full(num_s, depth) if step.max_depths is None else np.where(step.max_depths > 0, step.max_depths, depth)
    drafts: list[list[int]] = []
    parents: list[list[int]] = []
    num_expansions = 0
    started = time.perf_counter()
    for i, state in enumerate(step.states[j] for j in idx.tolist()):
        proposer.forget_pending(state.req_id)
        room = int(capacity[i] - next_pos[i])
        # Expansion e feeds at most e * top_k nodes: the deepest, depth - 1, needs that many slots past the root.
        fits = min(depth, int(depths[i]), 1 + room // top_k)
        if limits[i] <= 0 or room <= 0:
            drafts.append([])
            parents.append([])
            continue
        grower = _Expander(proposer, batch.block_table[rows[i]], int(next_pos[i]), features[i], top_k)
        tree = grow_eagle2_tree((root_values[i], root_ids[i]), grower.expand, fits, top_k, int(limits[i]))
        num_expansions += grower.num_expansions
        drafts.append(grower.full_ids(tree.tokens).tolist())
        parents.append(tree.parents.tolist())
    return DraftProposal(
        drafts,
        [None] * num_s,
        num_pass_requests=len(step.rows),
        draft_seconds=time.perf_counter() - started,
        # NOTE: a tree's drafting is its expansions (one head forward each), the same whatever its node budget: the
        # policy costs a tree d levels deep as d - 1 of them (core/spec_policy.py).
        num_draft_tokens=num_expansions,
        parents=parents,
    )


class _Expander:
    """grow_eagle2_tree's `expand` callback for one request: runs the head over the frontier and its ancestors."""

    def __init__(
        self,
        proposer: EagleProposer,
        block_table: np.ndarray,  # [max_blocks] the request's row of the batch's block table
        root_pos: int,
        root_feature: torch.Tensor,  # [hidden] the head's predicted feature of the root's position
        top_k: int,
    ) -> None:
        self.proposer = proposer
        self.top_k = top_k
        self.block_table = block_table
        self.root_pos = root_pos
        self.root_feature = root_feature
        self.features: dict[int, torch.Tensor] = {}  # pool node -> the head's output at it (its children's feature)
        self.num_expansions = 0
        # Draft-vocabulary column -> full id, copied to the host once per tree rather than once per expansion.
        vocab = proposer.draft_vocab
        self.vocab_ids = None if vocab is None else vocab.token_ids.cpu().numpy().astype(np.int64)

    def full_ids(self, tokens: np.ndarray) -> np.ndarray:
        """Pool tokens (draft-vocabulary columns when the head has one) -> full vocabulary ids."""
        return tokens if self.vocab_ids is None else self.vocab_ids[tokens]

    def expand(self, pool: DraftTree, frontier: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        proposer = self.proposer
        self.num_expansions += 1
        closure: set[int] = set()
        for f in frontier.tolist():
            while f >= 0 and f not in closure:
                closure.add(f)
                f = int(pool.parents[f])
        nodes = np.array(sorted(closure), dtype=np.int64)  # creation order is topological
        local = {int(n): j for j, n in enumerate(nodes)}
        sub = DraftTree(
            pool.tokens[nodes],
            np.array([local.get(int(pool.parents[n]), -1) for n in nodes], dtype=np.int64),
            pool.scores[nodes],
        )
        num = len(nodes)
        # Head position root + d - 1 for a node at depth d; KV slots: the run of positions after the root's.
        positions = self.root_pos + sub.depths() - 1
        logical = self.root_pos + np.arange(num)
        bs = proposer.block_size
        slots = self.block_table[logical // bs].astype(np.int64) * bs + logical % bs
        inputs = AttentionInputs(
            num_decodes=1 if num == 1 else 0,
            query_start_loc=np.array([0, num], dtype=np.int64),
            seq_lens=np.array([self.root_pos + num], dtype=np.int64),
            block_table=self.block_table[None, :],
            slot_mapping=slots,
            block_size=bs,
            query_masks={0: sub.ancestor_mask()[1:, 1:]} if num > 1 else None,
        )
        feats = torch.stack([self.features.get(int(p), self.root_feature) for p in pool.parents[nodes].tolist()])
        token_ids = proposer.to_device(self.full_ids(sub.tokens))
        md = proposer.backend.build_metadata(inputs)
        embeds = proposer.target.model.embed_tokens(token_ids)
        out = proposer.head(embeds, feats, proposer.to_device(positions), proposer.kv_caches[0], md)
        for j, n in enumerate(nodes.tolist()):
            self.features[n] = out[j]
        # The LM head over the frontier only: the ancestors' rows were scored when they were the frontier.
        picked = proposer.to_device(np.array([local[int(f)] for f in frontier], dtype=np.int64))
        return _top_log_probs(proposer, proposer.draft_logits(out[picked]), self.top_k)


def _top_log_probs(proposer: EagleProposer, logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[A, V] logits -> the k best tokens' log-probs and ids, each [A, k] on the host, best first: only these leave
    the device, not whole rows (sample/sampler.py's TopLogProbs)."""
    values, ids = proposer.sampler.top_log_probs(logits, min(k, logits.shape[-1]))
    return values.double().cpu().numpy(), ids.cpu().numpy()
