"""A launched step (its forward pass and sampling queued; with async scheduling one stays in flight while the
next is prepared) and the write-back of its tokens into the batch rows once they reach the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.core.sched_output import SchedulerOutput
from kvserve.sample.sampler import SamplerOutput
from kvserve.worker.input_batch import InputBatch, RequestState
from kvserve.worker.step_inputs import StepInputs


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are queued; the runner's `_finish` reads its tokens, builds its output."""

    so: SchedulerOutput
    step: StepInputs
    hidden: torch.Tensor  # [T, hidden] (a model proposer reads it)
    states: list[RequestState]  # of the requests that sample, in order
    num_logits: np.ndarray  # [S] scored positions per sampling request: its drafts + 1
    # Where each request's first new token goes in its row; None: a verification step, whose rows are updated in
    # _finish (its number of tokens is known only then).
    positions: np.ndarray | None
    tokens: torch.Tensor | None  # [S] or [S, K + 1] on the device (None: no request samples)
    num_out: torch.Tensor | None  # [S] tokens each request emits (verification steps only)
    host: torch.Tensor | None  # `tokens` on the host once `ready` has passed
    ready: torch.cuda.Event | None
    out: SamplerOutput | None  # for the logprobs
    started: float = 0.0  # perf_counter() when execute_model began the step


def write_tokens(launched: LaunchedStep, batch: InputBatch, sampled_lists: list, logprobs_lists: list) -> None:
    """Wait for `launched`'s tokens, write them into the batch rows (a verification step: its accepted drafts and
    one more, its computed count cut back past the rejected ones), and fill each sampling request's entry of
    `sampled_lists` (and of `logprobs_lists`, when it asked) by its index in the step."""
    if launched.ready is not None:
        launched.ready.synchronize()
    assert launched.host is not None
    step = launched.step
    sample_idx = step.sample_idx.tolist()
    if launched.positions is not None:  # one token each, counted in its row at launch
        tokens_np = launched.host.numpy()
        tokens = tokens_np.tolist()
        # Async: a request finished or preempted since has left its row (maybe to another request). The rows
        # still held are written at once (a per-request numpy write costs as much as the rest of this loop).
        held, rows = [], []
        states, live = launched.states, batch.states
        for j, i in enumerate(sample_idx):
            state = states[j]
            if live.get(state.req_id) is state:
                held.append(j)
                rows.append(state.row)
            sampled_lists[i] = [tokens[j]]
        if held:
            batch.token_ids[rows, launched.positions[held]] = tokens_np[held]
            batch.pending[rows] = -1
        num_out = np.ones(len(sample_idx), dtype=np.int64)
    else:  # a verification step (synchronous): the accepted drafts and one more token each
        assert launched.num_out is not None
        tokens_np = launched.host.cpu().numpy()
        num_out = launched.num_out.cpu().numpy()
        rows = step.rows[step.sample_idx]
        # Only accepted positions' KV stays valid.
        batch.num_computed_tokens[rows] -= (launched.num_logits - 1) - (num_out - 1)
        starts = batch.num_tokens[rows]
        for j, i in enumerate(sample_idx):
            emitted = tokens_np[j, : int(num_out[j])]
            batch.token_ids[rows[j], starts[j] : starts[j] + len(emitted)] = emitted
            sampled_lists[i] = emitted.tolist()
        batch.num_tokens[rows] += num_out
    out = launched.out
    if out is not None and out.logprobs is not None:
        collect_logprobs(out, step.sample_idx, launched.states, launched.num_logits, num_out, logprobs_lists)


def collect_logprobs(
    out: SamplerOutput,
    sample_idx: np.ndarray,
    states: list[RequestState],
    num_logits: np.ndarray,
    num_out: np.ndarray,
    dest: list,
) -> None:
    """`out` has one row per scored position; request j's emitted tokens are its first num_out[j] rows."""
    assert out.logprobs is not None and out.logprob_token_ids is not None and out.sampled_ranks is not None
    ids = out.logprob_token_ids.tolist()
    lps = out.logprobs.tolist()
    ranks = out.sampled_ranks.tolist()
    first_row = np.cumsum(num_logits) - num_logits
    for j, (i, state) in enumerate(zip(sample_idx.tolist(), states, strict=True)):
        n = state.sampling_params.logprobs
        if n is None:
            continue
        r0 = int(first_row[j])
        dest[i] = [(ids[r][: n + 1], lps[r][: n + 1], ranks[r]) for r in range(r0, r0 + int(num_out[j]))]
