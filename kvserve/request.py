"""Request state inside the engine core (pure Python; the model runner never sees these objects)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from kvserve.core.hashing import BlockHash, extend_block_hashes
from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Blocks allocated, KV being loaded by the KV connector (kvserve.kv_transfer); not schedulable until loaded.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    # Preempted with its KV in the swap space; resumes by swapping it back in.
    SWAPPED = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class EngineCoreRequest:
    """What the frontend sends to the engine core: already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    # Resolved by the frontend: the user's max_tokens, or whatever room is left up to max_model_len.
    max_tokens: int
    # For the KV connector, from the client (vLLM's field: e.g. where a prefill instance left this prompt's KV).
    kv_transfer_params: dict[str, Any] | None = None


class Request:
    """A request as the scheduler tracks it.

    `all_token_ids` = prompt + generated tokens. `num_computed_tokens` counts tokens whose KV is in the cache
    (or scheduled to be written by the step in flight). `block_hashes[i]` is the chained hash of tokens
    [i*block_size, (i+1)*block_size) and exists only for full blocks.
    """

    def __init__(self, core_req: EngineCoreRequest, block_size: int) -> None:
        self.request_id = core_req.request_id
        self.sampling_params = core_req.sampling_params
        self.eos_token_ids = core_req.eos_token_ids
        self.arrival_time = core_req.arrival_time or time.time()
        self.prompt_token_ids = list(core_req.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.max_tokens = core_req.max_tokens
        self.kv_transfer_params = core_req.kv_transfer_params
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Prompt tokens found in the prefix cache at first admission (reported back to the user).
        self.num_cached_tokens = -1
        self.first_scheduled_time: float | None = None
        self.has_reported = False  # whether an EngineCoreOutput went out for it yet
        # Speculative decoding: drafts the runner proposed for the next step (not part of all_token_ids), and
        # the speculation policy's state (kvserve.core.spec_policy.SpecRequestState), set by the scheduler.
        self.spec_token_ids: list[int] = []
        # An EAGLE-2 draft tree's parents (spec_decode/tree.py) when the drafts above are a tree's nodes; None: a chain.
        self.spec_parents: list[int] | None = None
        self.spec_state: Any = None
        # Async scheduling: tokens being sampled by steps in flight, not yet in all_token_ids.
        self.num_output_placeholders = 0
        # Structured outputs: the parser of its grammar (kvserve.structured_output.matcher.RequestGrammar), set by
        # the engine core; None for an unconstrained request.
        self.grammar: Any = None

        self.block_size = block_size
        salt = self.sampling_params.cache_salt
        self._first_block_extra_keys: tuple | None = (salt,) if salt else None
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        all_token_ids = self.all_token_ids
        all_token_ids.append(token_id)
        if len(all_token_ids) % self.block_size == 0:
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self._first_block_extra_keys)
