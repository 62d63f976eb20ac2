"""The proposer interface: after a step, propose up to k next tokens for each request that just sampled.

One interface for every proposer, so the runner never asks which kind it holds:
- n-gram (`ngram.py`) reads the tokens only, costs nothing to run and holds no KV;
- model proposers (`model_proposer.py`: a draft model, an EAGLE head) run a model with their own KV pool, which
  mirrors the target's block ids: its bytes count in every block (`bytes_per_block`), its pool is allocated with
  the target's, moved with it by swap and KV connectors (`kv_caches`), named in the KV layout (`layout_id`), and
  their sampled drafts carry a distribution q for the rejection sampler (`draft_probs`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvserve.attention.base import AttentionInputs
from kvserve.worker.input_batch import InputBatch, RequestState


@dataclass
class DraftStepInputs:
    """The target's step as a proposer sees it, after verification (batch rows hold the emitted tokens and the
    rolled-back computed counts)."""

    batch: InputBatch
    states: list[RequestState]  # [R] in step order
    rows: np.ndarray  # [R] InputBatch rows
    input_ids: np.ndarray  # [T] the target's input tokens
    positions: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [R + 1]
    attn_inputs: AttentionInputs  # the target's step layout (same pool shape, so valid for the draft pool)
    attn_metadata: object  # the target backend's metadata for attn_inputs (None after a replayed CUDA graph)
    hidden: torch.Tensor  # [T, hidden] the target's last hidden states (pre final norm)
    sample_idx: np.ndarray  # [S] indices into the step's requests that emitted tokens this step
    max_drafts: np.ndarray  # [S] most drafts worth proposing for each (0..K: the speculation policy's limit)
    # [R] per step request: the policy gives it drafts (limit > 0). A model proposer runs over the others' positions
    # only once they are given drafts again (it catches up then); None: all of them.
    awake: np.ndarray | None = None
    # [S] draft trees: the levels to grow each request's tree to (the policy's; 0: tree_depth). None: all at tree_depth.
    max_depths: np.ndarray | None = None


@dataclass
class DraftProposal:
    drafts: list[list[int]]  # [S] per sampling request, at most K tokens
    # [S] per sampling request its q [k_i, V] fp32, or None where the request is greedy (one-hot q) or the
    # proposer draws no distribution (n-gram).
    probs: list[torch.Tensor | None]
    # What it cost, for the speculation policy: requests the proposer's pass ran over (the rest of the call's
    # time is the pass's), and the seconds and tokens of its draft steps.
    num_pass_requests: int = 0
    draft_seconds: float = 0.0
    num_draft_tokens: int = 0
    # Draft trees (spec_decode/tree.py): [S] per sampling request its nodes' parent indices (-1: the root), the
    # drafts being the nodes' tokens in the same topological order. None: chains.
    parents: list[list[int]] | None = None


class Proposer(ABC):
    k: int  # most drafts per request and step

    # True for proposers that run a model: they must see every step that computes tokens (their KV mirrors the
    # target's), and drafting costs compute, so the runner asks for drafts only where the scheduler will verify
    # some. False: drafts are free to make and the proposer sees only steps in which requests sampled.
    runs_model: bool = False

    @abstractmethod
    def propose(self, step: DraftStepInputs) -> DraftProposal:
        """Drafts for the requests `step.sample_idx` names (a proposer may return more than `max_drafts`: the
        scheduler trims; a model proposer drafts no more, since each costs a forward pass)."""

    def bytes_per_block(self) -> int:
        """What the proposer's own KV pool adds to each block of the target's (0: none)."""
        return 0

    def layout_id(self) -> str | None:
        """What decides the meaning of the bytes of the proposer's blocks (None: it has no pool)."""
        return None

    def allocate_kv_cache(self, num_blocks: int) -> None:  # noqa: B027 - optional hook
        """Allocate the proposer's pool with the target's block count (once the target's pool is sized)."""

    @property
    def kv_caches(self) -> list[Any]:
        """The proposer's per-layer (K, V) pool, addressed by the target's block ids ([] without one)."""
        return []

    def draft_probs(self, req_ids: list[str], draft_ids: np.ndarray, num_drafts: np.ndarray) -> torch.Tensor | None:
        """[S, K, V] q of the drafts being verified, or None where every draft is a point mass (greedy, n-gram)."""
        return None

    def forget(self, req_id: str) -> None:  # noqa: B027 - optional hook
        """The request left the runner (finished, preempted)."""
