"""A step's model inputs, built from the runner's InputBatch by numpy indexing (no walk over Python objects)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvserve.attention.base import AttentionBackend, AttentionInputs
from kvserve.core.sched_output import SchedulerOutput
from kvserve.spec_decode.tree import DraftTree
from kvserve.worker.cuda_graph import DecodeGraphRunner
from kvserve.worker.input_batch import InputBatch, RequestState


@dataclass
class StepInputs:
    req_ids: list[str]  # in batch order: decodes first
    states: list[RequestState]
    rows: np.ndarray  # [R] InputBatch row of each request
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [R + 1]
    seq_lens: np.ndarray  # [R] context length after this step
    sample_idx: np.ndarray  # indices into req_ids of the requests that sample a token this step
    num_drafts: np.ndarray  # [R] draft tokens scheduled per request (0 without speculation)
    attn_inputs: AttentionInputs
    attn_metadata: Any  # None when the step replays a CUDA graph (its metadata lives in the graph's buffers)
    graph_size: int | None  # the padded batch size of the CUDA graph this step replays, or None (eager)
    token_rows: np.ndarray  # [T] InputBatch row of each token
    # Draft trees (worker/tree_step.py): the model's RoPE positions, where a tree node sits at root + depth while
    # its KV slot follows the step's run (`positions`, which address the slots); None: `positions`.
    model_positions: np.ndarray | None = None  # [T]
    trees: dict[int, DraftTree] | None = None  # step request index -> the tree it verifies
    # After the trees' walk: (scored rows, their noise keys) the walk drew with, which the rejection sampler
    # must draw with too; None: none were drawn (every tree request greedy, or no tree).
    tree_keys: tuple[np.ndarray, torch.Tensor] | None = None


def prepare_step_inputs(
    batch: InputBatch,
    so: SchedulerOutput,
    num_scheduled: dict[str, int],
    block_size: int,
    backend: AttentionBackend,
    graphs: DecodeGraphRunner | None,
) -> StepInputs:
    """Token ids, positions, slot mapping and attention metadata for the step's `num_scheduled` (req_id -> tokens),
    by numpy indexing; with `graphs`, decode-only steps that fit a captured graph get no eager metadata."""
    # Single-token queries (decodes) first: the attention backend batches them.
    req_ids = sorted(num_scheduled, key=lambda r: num_scheduled[r] > 1)
    states = [batch.states[r] for r in req_ids]
    rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
    q_lens = np.fromiter((num_scheduled[r] for r in req_ids), dtype=np.int64, count=len(states))

    start_pos = batch.num_computed_tokens[rows]
    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    token_req = np.repeat(np.arange(len(rows)), q_lens)  # request index of each token
    positions = start_pos[token_req] + np.arange(num_tokens) - query_start_loc[token_req]
    token_rows = rows[token_req]
    block_ids = batch.block_table[token_rows, positions // block_size].astype(np.int64)
    seq_lens = start_pos + q_lens
    num_drafts = np.fromiter(
        (len(so.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids), dtype=np.int64, count=len(req_ids)
    )
    attn_inputs = AttentionInputs(
        num_decodes=int(np.count_nonzero(q_lens == 1)),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=batch.block_table[rows],
        slot_mapping=block_ids * block_size + positions % block_size,
        block_size=block_size,
    )
    graph_size = graphs.padded_size(attn_inputs) if graphs is not None else None
    attn_metadata = backend.build_metadata(attn_inputs) if graph_size is None else None
    return StepInputs(
        req_ids=req_ids,
        states=states,
        rows=rows,
        input_ids=batch.token_ids[token_rows, positions],
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        # Only requests whose known tokens are now all computed produce a token (not mid-prompt chunks).
        sample_idx=np.flatnonzero(seq_lens >= batch.num_tokens[rows] + num_drafts),
        num_drafts=num_drafts,
        attn_inputs=attn_inputs,
        attn_metadata=attn_metadata,
        graph_size=graph_size,
        token_rows=token_rows,
    )


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """[3, 1, 2] -> [0, 1, 2, 0, 0, 1]."""
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total) - starts


def draft_matrix(batch: InputBatch, rows: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """[S, K] int64: each row's scheduled drafts (stored after its known tokens), zero-padded."""
    k = int(num_drafts.max())
    cols = batch.num_tokens[rows][:, None] + np.arange(k)[None, :]
    valid = np.arange(k)[None, :] < num_drafts[:, None]
    cols = np.where(valid, cols, 0)
    return np.where(valid, batch.token_ids[rows[:, None], cols], 0).astype(np.int64)
