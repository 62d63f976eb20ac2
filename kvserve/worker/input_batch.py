"""The runner's own per-request state, kept across steps in preallocated numpy rows.

Updated only from SchedulerOutputs (new requests in full, running ones as diffs) and from the tokens the runner
itself samples, so building a step's inputs is array indexing, not a walk over Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvserve.core.sched_output import CachedRequestData, NewRequestData
from kvserve.sampling_params import SamplingParams


@dataclass
class RequestState:
    req_id: str
    row: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)  # prompt + sampled tokens
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Async scheduling: the row's last token (at num_tokens - 1) is still being sampled by the step in flight;
        # its index among that step's sampled tokens, or -1 when the row's tokens are all on the host.
        self.pending = np.full(max_num_reqs, -1, dtype=np.int64)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.states: dict[str, RequestState] = {}

    def add(self, new: NewRequestData) -> None:
        if not self._free_rows:
            raise RuntimeError("input batch is full: scheduler exceeded max_num_seqs")
        row = self._free_rows.pop()
        tokens = new.prompt_token_ids + new.output_token_ids
        n = len(tokens)
        self.token_ids[row, :n] = tokens
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.pending[row] = -1
        self._append_blocks(row, new.block_ids)
        self.states[new.req_id] = RequestState(
            new.req_id, row, len(new.prompt_token_ids), new.sampling_params, new.eos_token_ids
        )

    def update(self, cached: CachedRequestData) -> None:
        row = self.states[cached.req_id].row
        self.num_computed_tokens[row] = cached.num_computed_tokens
        self._append_blocks(row, cached.new_block_ids)

    def remove(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None:
            self.pending[state.row] = -1
            self._free_rows.append(state.row)

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = self.num_blocks[row]
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def output_token_ids(self, state: RequestState, num_extra: int = 0) -> list[int]:
        """The generated tokens, plus the first `num_extra` draft tokens stored after them."""
        end = self.num_tokens[state.row] + num_extra
        return self.token_ids[state.row, state.num_prompt_tokens : end].tolist()

    def prompt_token_ids(self, state: RequestState) -> list[int]:
        return self.token_ids[state.row, : state.num_prompt_tokens].tolist()
