"""Unified token-budget scheduler (vLLM v1 style): no prefill/decode phases.

Every step, each request is given `num_tokens - num_computed_tokens` more tokens to compute, capped by one
shared budget (`max_num_batched_tokens`). That single rule covers decodes (1 token), chunked prefill (a slice of
a long prompt), prefix-cache hits (counted as computed at admission) and resumption after preemption.
Running requests go first, in admission order; then waiting requests in FCFS order while the budget,
`max_num_seqs` and the block pool allow. When a running request cannot get a block, the most recently
admitted running request is preempted by recompute: its blocks are freed and it goes back to the front of the
waiting queue, to be resumed later with the tokens it already generated. With `preemption_mode="swap"` its
computed blocks are copied to the swap space instead (core/swap.py) and copied back when it resumes; recompute
remains the fallback when the swap space is full.

A KV connector (kvserve.kv_transfer), when configured, is reached only through its scheduler-side interface: after
the prefix-cache lookup it may hold more of the prompt. A synchronous hit is scheduled at once with the loaded
tokens counted as computed (the worker loads them before the forward pass). An asynchronous one gets its blocks and
waits in WAITING_FOR_REMOTE_KVS (not schedulable, holding its blocks outside the prefix cache) until the worker
reports the load done or failed, then resumes from the waiting queue with the loaded tokens counted as computed
(after a failed load the rest is recomputed, unless the connector asks to end the request with an error instead).
A connector that cannot answer yet ("ask again") leaves the request in its place in the waiting queue for the next
step, like a request whose grammar is still compiling. When a request ends the connector may keep its blocks
(until it reports the save done) and give kv_transfer_params for the request's final output.

Speculative decoding fits the same rule: a decoding request that carries k draft tokens (proposed by the runner
after its last step) is scheduled 1 + k tokens, and its KV slots are allocated for all of them. Only tokens in
`all_token_ids` are ever hashed, so blocks holding drafts enter the prefix cache only once accepted tokens fill
them. After verification the computed count moves back by the number of rejected drafts; their slots are
overwritten by later steps.

Async scheduling (`async_scheduling`): the engine core schedules step N+1 before step N's tokens are back, so
that the host's work overlaps the device's. A request that samples in a step gets an output placeholder: one
token it will have, counted as known, which step N+1 may already compute (the runner feeds it from the device).
The placeholder turns into a real token when N's output arrives. Placeholders are never hashed (only
`all_token_ids` is). A request whose in-flight token reaches max_tokens or max_model_len is not scheduled again;
one that stops on EOS or a stop id has computed one step for nothing, whose output is dropped. A request
preempted while its step is in flight still takes that step's token (it was computed from a valid context).

Structured outputs: a constrained request carries its grammar's parser (`Request.grammar`). Each step the
scheduler asks the engine core's StructuredOutputManager for the tokens that may come next for those that sample,
and sends that bitmask with the step; each token it appends advances the parser. A request whose grammar is
complete finishes ("stop") without waiting for an EOS. A constrained request verifies only the drafts its grammar
allows, each position under its own mask.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_events import KVCacheEvent
from kvserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvserve.core.spec_policy import SpecDecodePolicy, SpecDecodingStats, accepted_nodes, node_depths
from kvserve.core.swap import SwapManager
from kvserve.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler
from kvserve.outputs import EngineCoreOutput, ModelRunnerOutput, SpecStepTiming
from kvserve.request import Request, RequestStatus
from kvserve.utils import cdiv

logger = logging.getLogger(__name__)

# The longest a step with nothing else to do waits for a grammar being compiled or a connector lookup.
_IDLE_POLL_S = 0.02


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by requests
    num_preemptions: int  # cumulative
    num_blocks: int
    num_free_blocks: int
    num_loading: int = 0  # waiting for their KV from the connector
    num_swapped_out: int = 0  # cumulative preemptions by swap (included in num_preemptions)
    num_swapped_in: int = 0
    num_swap_fallbacks: int = 0  # swap preemptions done by recompute because the swap space was full


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        spec_config: SpeculativeConfig | None = None,
        connector: KVConnectorScheduler | None = None,
        num_swap_blocks: int = 0,
        structured_output: Any = None,
        enable_kv_events: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        """`sliding_window`: the KV cache spec's `freeable_window` (KVCacheManager releases what it never reads)."""
        self.config = config
        self.async_scheduling = config.async_scheduling
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, enable_kv_events, sliding_window
        )
        self.enable_kv_events = enable_kv_events
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ids the runner still holds state for but must drop at the next step.
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_config = spec_config
        self.spec_policy = SpecDecodePolicy(spec_config) if spec_config is not None else None
        self.spec_stats = SpecDecodingStats()
        # KV slots a model proposer writes past a request's step tokens (none for n-gram, which runs no model).
        self._lookahead_slots = (
            0 if spec_config is None or spec_config.method == "ngram" else spec_config.num_lookahead_slots
        )
        self.connector = connector
        # kvserve.structured_output.matcher.StructuredOutputManager (fills the step's bitmask), or None.
        self.structured_output = structured_output
        self.swap = SwapManager(num_swap_blocks) if config.preemption_mode == "swap" else None
        # WAITING_FOR_REMOTE_KVS requests (and aborted ones whose load is still in flight), with the number of
        # external tokens being loaded for each.
        self.loading: dict[str, tuple[Request, int]] = {}
        # Finished requests whose blocks the connector still reads (request_finished returned True).
        self._saving: dict[str, Request] = {}
        # Requests scheduled in this step with a synchronous load (the tokens computed before it).
        self._sync_loads: dict[str, int] = {}
        # Requests ended outside a step's tokens (their grammar failed to compile, their remote KV failed to load
        # and the connector refused a recompute), reported with the next step's outputs.
        self._early_outputs: list[EngineCoreOutput] = []
        # step_id -> the requests scheduled in that step, until its output is in.
        self._num_steps = 0
        self._step_requests: dict[int, dict[str, Request]] = {}

    # ---------------------------------------------------------------- requests in and out

    @property
    def max_tokens_per_request(self) -> int:
        """Most tokens (prompt + output) one request may ever hold: the model length and the whole pool."""
        return min(self.config.max_model_len, self.kv.num_blocks * self.block_size)

    def add_request(self, request: Request) -> None:
        """Queue a request; refuses one that could never be scheduled (it would wait forever)."""
        needed = request.num_prompt_tokens + request.max_tokens
        if needed > self.max_tokens_per_request:
            raise ValueError(
                f"request {request.request_id!r} needs {needed} tokens (prompt {request.num_prompt_tokens} + "
                f"max_tokens {request.max_tokens}) but at most {self.max_tokens_per_request} fit "
                f"(max_model_len {self.config.max_model_len}, KV cache {self.kv.num_blocks} blocks of "
                f"{self.block_size})"
            )
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        if self.spec_policy is not None:
            request.spec_state = self.spec_policy.new_state(self._num_steps)
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish (e.g. abort) requests wherever they are; their blocks are freed at once."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # A load is writing its blocks: they are freed when the worker reports it (_on_load_done).
                request.status = status
                self._finished_req_ids.add(req_id)
                del self.requests[req_id]
                if self.connector is not None:
                    # Its blocks stay until the load is reported whatever the connector says.
                    self.connector.request_finished(request, self.kv.get_block_ids(req_id))
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
                if request.status == RequestStatus.SWAPPED:
                    assert self.swap is not None
                    self.swap.drop(req_id)
            request.status = status
            self._free_request(request)

    def has_structured_output_requests(self) -> bool:
        """A constrained request is running or waiting: its next mask needs its last token, so an async engine
        runs synchronous steps while one is there."""
        return any(r.grammar is not None for r in self.running) or any(r.grammar is not None for r in self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(
            self.running
            or self.waiting
            or self.loading
            or self._saving
            or (self.connector is not None and self.connector.has_pending_work())
        )

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.loading)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        num_drafts = self._plan_drafts()
        scheduled_spec: dict[str, list[int]] = {}
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []

        # 1) Running requests, oldest first. Victims of preemption are taken from the end of `running`, which
        #    holds only requests not yet scheduled in this step, so nothing scheduled is ever taken back.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_output_placeholders and self._ends_in_flight(request):
                i += 1
                continue
            num_known = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            assert num_known > 0, f"running request {request.request_id} has nothing to compute"
            num_new = min(num_known + num_drafts.get(request.request_id, 0), budget)
            lookahead = self._lookahead(request.num_computed_tokens + num_new)
            while (new_block_ids := self.kv.allocate_slots(request, num_new, None, lookahead)) is None:
                victim = self.running.pop()
                swap_out += self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if new_block_ids is None:
                break
            cached_reqs.append(CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens))
            num_scheduled[request.request_id] = num_new
            if num_new > num_known:
                scheduled_spec[request.request_id] = request.spec_token_ids[: num_new - num_known]
            request.spec_token_ids = []
            budget -= num_new
            i += 1

        # 2) Waiting requests, FCFS; none while preemption is freeing memory in this step. Those whose grammar
        #    still compiles, or whose connector cannot say yet what it holds, are passed over and keep their place.
        compiling: list[Request] = []
        passed_over: list[Request] = []
        asked_again = False
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.grammar is not None and not request.grammar.ready:
                compiling.append(self.waiting.popleft())
                passed_over.append(compiling[-1])
                continue
            if request.grammar is not None and request.grammar.failure is not None:
                self._fail_grammar(self.waiting.popleft())
                continue
            if request.status == RequestStatus.SWAPPED or request.request_id in self.kv.req_to_blocks:
                # Resumed: swapped out, or its connector load is done. Its computed tokens stay computed.
                num_new = request.num_tokens - request.num_computed_tokens
                if num_new > budget and not self.config.enable_chunked_prefill:
                    break
                num_new = min(num_new, budget)
                fresh = self.kv.allocate_slots(
                    request, num_new, None, self._lookahead(request.num_computed_tokens + num_new)
                )
                if fresh is None:
                    break
                block_ids = self.kv.get_block_ids(request.request_id)
                if request.status == RequestStatus.SWAPPED:
                    assert self.swap is not None
                    swap_in += self.swap.swap_in(request.request_id, block_ids)
                self.waiting.popleft()
            else:
                computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
                num_external, load_async = 0, False
                if self.connector is not None:
                    answer, load_async = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
                    if answer is None:  # ask again next step
                        passed_over.append(self.waiting.popleft())
                        asked_again = True
                        continue
                    num_external = answer
                    load_async = load_async and num_external > 0
                num_loaded = num_hit_tokens + num_external  # computed once the loads are in
                num_new = request.num_tokens - num_loaded
                if load_async:
                    # Only the blocks to load into: the request computes nothing until the load is reported.
                    block_ids = self.kv.allocate_slots(request, num_external, computed_blocks, delay_caching=True)
                else:
                    if num_new > budget and not self.config.enable_chunked_prefill:
                        break
                    num_new = min(num_new, budget)
                    # Loaded blocks join the prefix cache only once the load is reported done (never read before).
                    block_ids = self.kv.allocate_slots(
                        request,
                        num_external + num_new,
                        computed_blocks,
                        self._lookahead(num_loaded + num_new),
                        delay_caching=num_external > 0,
                    )
                if block_ids is None:
                    break
                self.waiting.popleft()
                self.kv.record_lookup(request.num_tokens, num_hit_tokens)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_loaded
                    request.first_scheduled_time = time.time()
                request.num_computed_tokens = num_hit_tokens
                block_ids = self.kv.get_block_ids(request.request_id)
                if self.connector is not None:
                    self.connector.update_state_after_alloc(request, block_ids, num_external)
                if load_async:
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    self.loading[request.request_id] = (request, num_external)
                    continue
                if num_external:
                    # Loaded by the worker before this step's forward pass; reported in this step's output.
                    request.num_computed_tokens = num_loaded
                    self._sync_loads[request.request_id] = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    eos_token_ids=request.eos_token_ids,
                    block_ids=block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        self.waiting.extendleft(reversed(passed_over))
        if asked_again and not num_scheduled and not self.running:
            # Nothing to run but connector lookups in flight: wait a little for one rather than spin.
            assert self.connector is not None
            self.connector.wait_for_lookups(_IDLE_POLL_S)
        elif compiling and not num_scheduled and not self.running:
            # Nothing to run but grammars being compiled: wait a little for one rather than spin the engine loop
            # (which would take a core from the compile). Short, so that new requests and aborts are not held up.
            compiling[0].grammar.wait(_IDLE_POLL_S)

        self._num_steps += 1
        if num_scheduled and self.async_scheduling:  # synchronous: the output comes before any id can be reused
            self._step_requests[self._num_steps] = {req_id: self.requests[req_id] for req_id in num_scheduled}
        # Advance at schedule time: the step in flight is responsible for these tokens now.
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if self.async_scheduling and request.num_computed_tokens >= request.num_tokens + (
                request.num_output_placeholders
            ):
                request.num_output_placeholders += 1  # it samples in this step

        grammar_req_ids, grammar_bitmask = self._grammar_bitmask(num_scheduled, scheduled_spec)
        # A request both preempted and rescheduled in one step cannot happen (no admissions after preemption),
        # so the runner can drop every preempted id before adding new requests.
        finished = self._finished_req_ids | preempted
        self._finished_req_ids = set()
        assert not (swap_out and swap_in), "a step that preempts admits nothing"
        limits, depths = self._draft_limits()
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            scheduled_spec_decode_tokens=scheduled_spec,
            spec_draft_limits=limits,
            spec_tree_depths=depths,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            structured_output_request_ids=grammar_req_ids,
            grammar_bitmask=grammar_bitmask,
            grammar_bitmask_words=self.structured_output.num_words if grammar_bitmask else 0,
            step_id=self._num_steps,
        )
        if self.connector is not None:
            so.kv_connector_metadata = self.connector.build_connector_meta(so, self.requests)
        return so

    def _plan_drafts(self) -> dict[str, int]:
        """How many of its proposed drafts each decoding request verifies this step: at most the limit the
        policy granted with the last step (the proposer drafted no more than that)."""
        policy = self.spec_policy
        if policy is None:
            return {}
        plan: dict[str, int] = {}
        for request in self.running:
            if request.spec_token_ids and request.num_tokens - request.num_computed_tokens == 1:
                n = policy.num_to_verify(request.spec_state, len(request.spec_token_ids))
                if n and request.grammar is not None and request.spec_parents is None:
                    # Only drafts its grammar allows: the others would be rejected. (A tree keeps its nodes: the
                    # bitmask of a refused node's parent excludes it, so it is never accepted.)
                    n = request.grammar.num_valid(request.spec_token_ids[:n])
                plan[request.request_id] = n
        return plan

    def _draft_limits(self) -> tuple[dict[str, int], dict[str, int]]:
        """The policy's limit for each running request's drafts after this step (where below
        num_speculative_tokens; 0 leaves it out of the proposer), and a tree's depth (where below tree_depth);
        called once the step's tokens are counted."""
        policy = self.spec_policy
        if policy is None:
            return {}, {}
        samples = [r.num_computed_tokens >= r.num_tokens for r in self.running]
        limits = policy.grant([r.spec_state for r in self.running], samples, self._num_steps)
        k, depth = policy.k, policy.depth
        depths = {}
        if policy.tree:
            depths = {
                r.request_id: r.spec_state.depth
                for r, n in zip(self.running, limits, strict=True)
                if 0 < n and r.spec_state.depth < depth
            }
        return {r.request_id: n for r, n in zip(self.running, limits, strict=True) if n < k}, depths

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules (max_tokens, max_model_len, EOS, stop ids), free finished."""
        if runner_output.kv_connector_output is not None:
            self._update_from_connector(runner_output.kv_connector_output)
        if runner_output.spec_timing is not None and self.spec_policy is not None:
            self._observe_spec_timing(scheduler_output, runner_output.spec_timing)
        outputs, self._early_outputs = self._early_outputs, []
        logprobs = runner_output.logprobs
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        step_requests = self._step_requests.pop(scheduler_output.step_id, None)
        requests, sampled = self.requests, runner_output.sampled_token_ids
        # NOTE: this loop runs once per request per step (a GPU step at batch 256 waits on it): locals, and the
        # one-token case without drafts or grammar kept to a few attribute reads.
        for idx, req_id in enumerate(runner_output.req_ids):
            token_ids = sampled[idx]
            if not token_ids:
                continue
            request = requests.get(req_id)
            if (
                request is None
                or request.status > RequestStatus.PREEMPTED  # finished
                or (step_requests is not None and step_requests.get(req_id, request) is not request)
            ):
                # Aborted while the step ran, and maybe its id taken by a new request since (async). A failed
                # synchronous load has no tokens.
                continue
            if self.async_scheduling:
                # Zero already when the request was preempted after the step was scheduled.
                request.num_output_placeholders = max(0, request.num_output_placeholders - 1)
            was_running = request.status == RequestStatus.RUNNING
            was_swapped = request.status == RequestStatus.SWAPPED
            drafts = spec_scheduled.get(req_id) if spec_scheduled else None
            if drafts:
                num_accepted = len(token_ids) - 1
                # The rejected drafts' KV slots are garbage now; later steps overwrite them.
                request.num_computed_tokens -= len(drafts) - num_accepted
                path = depths = None
                if request.spec_parents is not None:  # a tree: the policy learns from its accepted path's nodes
                    parents = list(request.spec_parents[: len(drafts)])
                    path, depths = accepted_nodes(drafts, parents, token_ids), node_depths(parents)
                self._record_drafts(request, len(drafts), num_accepted, path, depths)
            grammar_completed = False
            if len(token_ids) == 1 and request.grammar is None:
                request.append_output_token_id(token_ids[0])
                self._check_stop(request)
                new_token_ids = token_ids
            else:
                new_token_ids = []
                for token_id in token_ids:
                    request.append_output_token_id(token_id)
                    new_token_ids.append(token_id)
                    if self._check_stop(request):
                        break
                    if request.grammar is not None and self._grammar_ends(request):
                        grammar_completed = request.status == RequestStatus.FINISHED_STOPPED
                        break
            output = EngineCoreOutput(
                req_id,
                new_token_ids,
                logprobs[idx][: len(new_token_ids)] if logprobs and logprobs[idx] else None,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                grammar_completed=grammar_completed,
            )
            if not request.has_reported:
                output.first_scheduled_time = request.first_scheduled_time
                request.has_reported = True
            if request.status > RequestStatus.PREEMPTED:  # finished by this step's tokens
                output.finish_reason = request.status.finish_reason
                output.stop_reason = request.stop_reason
                if was_running:
                    self.running.remove(request)
                else:  # async: preempted while its last step was in flight
                    self.waiting.remove(request)
                    if was_swapped:
                        assert self.swap is not None
                        self.swap.drop(req_id)
                output.kv_transfer_params = self._free_request(request)
            elif runner_output.spec_token_ids is not None and self.spec_config is not None:
                drafts = runner_output.spec_token_ids[idx]
                request.spec_token_ids = drafts[: self._max_drafts(request)] if drafts else []
                request.spec_parents = runner_output.spec_parents[idx] if runner_output.spec_parents else None
            outputs.append(output)
        return outputs

    def _check_stop(self, request: Request) -> bool:
        output_token_ids = request.output_token_ids
        num_output = len(output_token_ids)
        # _length_reached(request, 0), inline: once per request per step.
        if num_output >= request.max_tokens or len(request.all_token_ids) >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        params = request.sampling_params
        if num_output < params.min_tokens:
            return False
        last = output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:  # type: ignore[operator]
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        return False

    def _fail_grammar(self, request: Request) -> None:
        """A waiting request whose grammar failed to compile: finished ("abort"; the reason is logged)."""
        logger.warning("request %s: %s", request.request_id, request.grammar.failure)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free_request(request)
        self._early_outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="abort"))

    def _grammar_ends(self, request: Request) -> bool:
        """Advance the request's grammar by its last token: True when that completes the output (or, against the
        mask, breaks the grammar: the request then ends with "abort" rather than run on unconstrained)."""
        if not request.grammar.accept(request.output_token_ids[-1]):
            logger.warning("request %s: token refused by its grammar: %s", request.request_id, request.grammar.error)
            request.status = RequestStatus.FINISHED_ABORTED
            return True
        if request.grammar.is_terminated:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _grammar_bitmask(
        self, num_scheduled: dict[str, int], scheduled_spec: dict[str, list[int]]
    ) -> tuple[list[str], bytes | None]:
        """The constrained requests that sample in this step (all their known tokens computed) and their bitmask:
        a row for each, and one more per draft it verifies."""
        if self.structured_output is None:
            return [], None
        sampling = [
            self.requests[req_id]
            for req_id in num_scheduled
            if self.requests[req_id].grammar is not None
            and self.requests[req_id].num_computed_tokens >= self.requests[req_id].num_tokens
        ]
        if not sampling:
            return [], None
        grammars = [r.grammar for r in sampling]
        drafts = [scheduled_spec.get(r.request_id, []) for r in sampling]
        parents = [
            None if r.spec_parents is None else r.spec_parents[: len(d)] for r, d in zip(sampling, drafts, strict=True)
        ]
        return [r.request_id for r in sampling], self.structured_output.fill_bitmask(grammars, drafts, parents)

    # ---------------------------------------------------------------- helpers

    def _ends_in_flight(self, request: Request) -> bool:
        """Async: the tokens in flight take the request to max_tokens or max_model_len, so it finishes when they
        arrive and must not be scheduled again (its next position may not even exist)."""
        return self._length_reached(request, request.num_output_placeholders)

    def _length_reached(self, request: Request, num_more: int) -> bool:
        """The request is at max_tokens or max_model_len once `num_more` tokens beyond its own are added."""
        return (
            request.num_output_tokens + num_more >= request.max_tokens
            or request.num_tokens + num_more >= self.config.max_model_len
        )

    def _lookahead(self, num_tokens_after_step: int) -> int:
        """KV slots a model proposer writes past the step's tokens: its K draft steps (none for n-gram, which
        runs no model), within max_model_len."""
        if not self._lookahead_slots:
            return 0
        return max(0, min(self._lookahead_slots, self.config.max_model_len - num_tokens_after_step))

    def _max_drafts(self, request: Request) -> int:
        """Drafts that fit: 1 + k tokens are emitted at most, within max_tokens and max_model_len."""
        assert self.spec_config is not None
        room = min(request.max_tokens - request.num_output_tokens - 1, self.config.max_model_len - request.num_tokens)
        return max(0, min(self.spec_config.num_speculative_tokens, room))

    def _record_drafts(
        self,
        request: Request,
        num_drafts: int,
        num_accepted: int,
        path: list[int] | None = None,
        depths: list[int] | None = None,
    ) -> None:
        self.spec_stats.observe(num_drafts, num_accepted)
        assert self.spec_policy is not None
        self.spec_policy.observe_verification(request.spec_state, num_drafts, num_accepted, path, depths)

    def _observe_spec_timing(self, scheduler_output: SchedulerOutput, timing: SpecStepTiming) -> None:
        """Hand the runner's measured seconds to the policy; the step is decode-only when every request in it
        computed one known token (plus its drafts)."""
        assert self.spec_policy is not None
        spec = scheduler_output.scheduled_spec_decode_tokens
        decode_only = not scheduler_output.scheduled_new_reqs and all(
            n == 1 + len(spec.get(req_id, ())) for req_id, n in scheduler_output.num_scheduled_tokens.items()
        )
        self.spec_policy.observe_step(
            scheduler_output.total_num_scheduled_tokens,
            decode_only,
            timing.step_seconds,
            timing.pass_seconds,
            timing.num_pass_requests,
            timing.draft_seconds,
            timing.num_draft_tokens,
        )

    def _preempt(self, request: Request) -> list[tuple[int, int]]:
        """Free the request's blocks and queue it first; returns the swap-out pairs (empty: recompute)."""
        pairs = None
        if self.swap is not None and request.num_computed_tokens > 0:
            num_blocks = cdiv(request.num_computed_tokens, self.block_size)
            pairs = self.swap.swap_out(request.request_id, self.kv.get_block_ids(request.request_id)[:num_blocks])
        self.kv.free(request)
        if pairs is not None:
            request.status = RequestStatus.SWAPPED
        else:
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_output_placeholders = 0  # the step in flight still delivers its token (update_from_output)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        return pairs or []

    def _free_request(self, request: Request) -> dict | None:
        """Forget a finished request and free its blocks, unless the connector keeps them for a save or a remote
        reader (then they go when it reports the save done). Returns the connector's kv_transfer_params for the
        request's final output."""
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        params = None
        if self.connector is not None:
            keep, params = self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
            if keep:
                self._saving[request.request_id] = request
                return params
        self.kv.free(request)
        return params

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call: the pool's, then the connector's tiers' (kvserve/core/kv_events.py)."""
        if not self.enable_kv_events:
            return []
        events = self.kv.pool.take_events()
        if self.connector is not None:
            events += self.connector.take_events()
        return events

    def _update_from_connector(self, output: KVConnectorOutput) -> None:
        """Asynchronous loads done resume their requests first in the waiting queue (a failed one with the tokens
        that did load: the rest is recomputed). A failed synchronous load did not run in the step (the runner left
        it out): its request goes back there too, and the runner is told to forget it, since it is sent in full
        again. Loaded blocks join the prefix cache; finished saves release their requests' blocks."""
        assert self.connector is not None
        self.connector.update_connector_output(output)
        resumed: list[Request] = []
        sync_loads, self._sync_loads = self._sync_loads, {}
        for req_id, num_hit_tokens in sync_loads.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran: its blocks are already free
            if req_id in output.failed_loading:
                self.running.remove(request)
                request.num_computed_tokens = num_hit_tokens + output.failed_loading[req_id]
                request.num_cached_tokens = min(request.num_cached_tokens, request.num_computed_tokens)
                request.status = RequestStatus.WAITING
                request.spec_token_ids = []
                self._finished_req_ids.add(req_id)
                resumed.append(request)
            else:
                assert req_id in output.finished_loading, f"synchronous load of {req_id} not reported"
                self.kv.cache_blocks(request, request.num_computed_tokens)
        for req_id in sorted((output.finished_loading | set(output.failed_loading)) - set(sync_loads)):
            request, num_external = self.loading.pop(req_id)
            if request.is_finished:  # aborted while loading
                self.kv.free(request)
                continue
            if req_id in output.failed_loading and (error := self.connector.load_failure(request)) is not None:
                self._end_with_error(request, error)
                continue
            request.num_computed_tokens += output.failed_loading.get(req_id, num_external)
            request.num_cached_tokens = min(request.num_cached_tokens, request.num_computed_tokens)
            request.status = RequestStatus.WAITING
            resumed.append(request)
        resumed.sort(key=lambda r: r.arrival_time)
        self.waiting.extendleft(reversed(resumed))
        for req_id in output.finished_saving:
            request = self._saving.pop(req_id, None)
            if request is not None:
                self.kv.free(request)

    def _end_with_error(self, request: Request, error: str) -> None:
        """End a request whose remote KV did not load, where the connector refuses a recompute: finish reason
        "abort", the error in its final output's kv_transfer_params, its blocks freed."""
        logger.warning("request %s: %s", request.request_id, error)
        request.status = RequestStatus.FINISHED_ABORTED
        params = self._free_request(request)
        self._early_outputs.append(
            EngineCoreOutput(
                request.request_id, [], finish_reason="abort", kv_transfer_params={**(params or {}), "error": error}
            )
        )

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_preemptions=self.num_preemptions,
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.pool.num_free_blocks,
            num_loading=len(self.loading),
            num_swapped_out=self.swap.stats.num_swapped_out if self.swap else 0,
            num_swapped_in=self.swap.stats.num_swapped_in if self.swap else 0,
            num_swap_fallbacks=self.swap.stats.num_swap_fallbacks if self.swap else 0,
        )
