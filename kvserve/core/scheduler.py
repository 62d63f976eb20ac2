"""Unified token-budget scheduler (vLLM v1 style): no prefill/decode phases.

Every step, each request is given `num_tokens - num_computed_tokens` more tokens to compute, capped by one
shared budget (`max_num_batched_tokens`). That single rule covers decodes (1 token), chunked prefill (a slice of
a long prompt), prefix-cache hits (counted as computed at admission) and resumption after preemption.
Running requests go first, in admission order; then waiting requests in FCFS order while the budget,
`max_num_seqs` and the block pool allow. When a running request cannot get a block, the most recently
admitted running request is preempted by recompute: its blocks are freed and it goes back to the front of the
waiting queue, to be resumed later with the tokens it already generated.

Speculative decoding fits the same rule: a decoding request that carries k draft tokens (proposed by the runner
after its last step) is scheduled 1 + k tokens, and its KV slots are allocated for all of them. Only tokens in
`all_token_ids` are ever hashed, so blocks holding drafts enter the prefix cache only once accepted tokens fill
them. After verification the computed count moves back by the number of rejected drafts; their slots are
overwritten by later steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvserve.core.spec_decode import SpecDecodePolicy, SpecDecodingStats
from kvserve.outputs import EngineCoreOutput, ModelRunnerOutput
from kvserve.request import Request, RequestStatus


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by requests
    num_preemptions: int  # cumulative
    num_blocks: int
    num_free_blocks: int


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        spec_config: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ids the runner still holds state for but must drop at the next step.
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_config = spec_config
        self.spec_policy = SpecDecodePolicy(spec_config) if spec_config is not None else None
        self.spec_stats = SpecDecodingStats()

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
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish (e.g. abort) requests wherever they are; their blocks are freed at once."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        num_drafts = self._plan_drafts()
        scheduled_spec: dict[str, list[int]] = {}

        # 1) Running requests, oldest first. Victims of preemption are taken from the end of `running`, which
        #    holds only requests not yet scheduled in this step, so nothing scheduled is ever taken back.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_known = request.num_tokens - request.num_computed_tokens
            assert num_known > 0, f"running request {request.request_id} has nothing to compute"
            num_new = min(num_known + num_drafts.get(request.request_id, 0), budget)
            lookahead = self._lookahead(request.num_computed_tokens + num_new)
            while (new_block_ids := self.kv.allocate_slots(request, num_new, None, lookahead)) is None:
                victim = self.running.pop()
                self._preempt(victim)
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

        # 2) Waiting requests, FCFS; none while preemption is freeing memory in this step.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            assert request.num_computed_tokens == 0
            block_ids = self.kv.allocate_slots(
                request, num_new, computed_blocks, self._lookahead(num_hit_tokens + num_new)
            )
            if block_ids is None:
                break
            self.waiting.popleft()
            self.kv.record_lookup(request.num_tokens, num_hit_tokens)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.time()
            request.num_computed_tokens = num_hit_tokens
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
                    num_computed_tokens=num_hit_tokens,
                )
            )
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        # Advance at schedule time: the step in flight is responsible for these tokens now.
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n

        # A request both preempted and rescheduled in one step cannot happen (no admissions after preemption),
        # so the runner can drop every preempted id before adding new requests.
        finished = self._finished_req_ids | preempted
        self._finished_req_ids = set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            scheduled_spec_decode_tokens=scheduled_spec,
        )

    def _plan_drafts(self) -> dict[str, int]:
        """How many of its proposed drafts each decoding request verifies this step (the adaptive rule)."""
        policy = self.spec_policy
        if policy is None:
            return {}
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        budget = policy.draft_token_budget(len(decodes))
        plan: dict[str, int] = {}
        for request in sorted(decodes, key=lambda r: -r.spec_acceptance_ema):
            if budget <= 0:
                break
            if request.spec_token_ids:
                n = min(len(request.spec_token_ids), policy.limit(request.spec_acceptance_ema, len(decodes)), budget)
                plan[request.request_id] = n
                budget -= n
        return plan

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules (max_tokens, max_model_len, EOS, stop ids), free finished."""
        outputs: list[EngineCoreOutput] = []
        logprobs = runner_output.logprobs
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        for idx, req_id in enumerate(runner_output.req_ids):
            token_ids = runner_output.sampled_token_ids[idx]
            if not token_ids:
                continue
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            drafts = spec_scheduled.get(req_id)
            if drafts:
                num_accepted = len(token_ids) - 1
                # The rejected drafts' KV slots are garbage now; later steps overwrite them.
                request.num_computed_tokens -= len(drafts) - num_accepted
                self._record_drafts(request, len(drafts), num_accepted)
            new_token_ids: list[int] = []
            for token_id in token_ids:
                request.append_output_token_id(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(request):
                    break
            output = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_token_ids,
                new_logprobs=logprobs[idx][: len(new_token_ids)] if logprobs and logprobs[idx] else None,
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
            if not request.has_reported:
                output.first_scheduled_time = request.first_scheduled_time
                request.has_reported = True
            if request.is_finished:
                output.finish_reason = request.status.finish_reason
                output.stop_reason = request.stop_reason
                self.running.remove(request)
                self._free_request(request)
            elif runner_output.spec_token_ids is not None and self.spec_config is not None:
                request.spec_token_ids = runner_output.spec_token_ids[idx][: self._max_drafts(request)]
            outputs.append(output)
        return outputs

    def _check_stop(self, request: Request) -> bool:
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            return False
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:  # type: ignore[operator]
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        return False

    # ---------------------------------------------------------------- helpers

    def _lookahead(self, num_tokens_after_step: int) -> int:
        """KV slots a model proposer writes past the step's tokens: its K draft steps (none for n-gram, which
        runs no model), within max_model_len."""
        spec = self.spec_config
        if spec is None or spec.method == "ngram":
            return 0
        return max(0, min(spec.num_speculative_tokens, self.config.max_model_len - num_tokens_after_step))

    def _max_drafts(self, request: Request) -> int:
        """Drafts that fit: 1 + k tokens are emitted at most, within max_tokens and max_model_len."""
        assert self.spec_config is not None
        room = min(request.max_tokens - request.num_output_tokens - 1, self.config.max_model_len - request.num_tokens)
        return max(0, min(self.spec_config.num_speculative_tokens, room))

    def _record_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        self.spec_stats.observe(num_drafts, num_accepted)
        assert self.spec_policy is not None
        request.spec_acceptance_ema = self.spec_policy.update_ema(request.spec_acceptance_ema, num_drafts, num_accepted)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free_request(self, request: Request) -> None:
        self.kv.free(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_preemptions=self.num_preemptions,
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.pool.num_free_blocks,
        )
