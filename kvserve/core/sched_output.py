"""SchedulerOutput: the plain value the scheduler hands the model runner each step.

New (or resumed-after-preemption) requests are sent in full; requests the runner already holds are sent as
diffs. The runner keeps its own per-request state and never sees scheduler objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (empty for a fresh request): the runner re-feeds them as context.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int  # before this step (prefix-cache hits and tokens a KV connector loads)


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens to compute this step, for every scheduled request.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the runner must forget before this step: finished, aborted, preempted or whose synchronous KV load
    # failed since the last one. Those that go on come back later as new requests (NewRequestData) with their
    # output tokens so far.
    finished_req_ids: set[str] = field(default_factory=set)
    # req_id -> draft tokens to verify this step (they follow the request's known tokens; counted in
    # num_scheduled_tokens).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> most drafts worth proposing for the request after this step, where the adaptive rule gives fewer
    # than num_speculative_tokens (absent: all of them). A draft model's steps cost time whether or not their
    # drafts are verified, so its proposer drafts no more than this.
    spec_draft_limits: dict[str, int] = field(default_factory=dict)
    # req_id -> the levels to grow the request's draft tree to, where the policy gives fewer than tree_depth
    # (absent: all of them; chains: always empty).
    spec_tree_depths: dict[str, int] = field(default_factory=dict)
    # Swap preemption, as (device block id, swap block id) pairs: copied before this step's forward. A step
    # never has both (no admissions in a step that preempts), so their order does not matter.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The KV connector's plain-dataclass message to its worker side (kvserve.kv_transfer.base), or None.
    kv_connector_metadata: Any = None
    # Structured outputs: the constrained requests that sample in this step, and the tokens each may sample
    # (kvserve.structured_output.matcher: int32 words, `grammar_bitmask_words` per row; a row per request in this
    # order, and one more per draft it verifies).
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: bytes | None = None
    grammar_bitmask_words: int = 0
    # The scheduler's number for the step: its output is matched to the requests scheduled in it, not just to
    # their ids (async scheduling: an id may be reused by a new request while the old one's step is in flight).
    step_id: int = 0

    @property
    def is_empty(self) -> bool:
        """No tokens to compute (the runner may still have swaps or KV transfers to do)."""
        return self.total_num_scheduled_tokens == 0
