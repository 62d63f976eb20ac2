"""Helpers for pure-Python core tests: requests and a deterministic fake model runner."""

from __future__ import annotations

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.outputs import EngineCoreOutput, ModelRunnerOutput
from kvserve.request import EngineCoreRequest, Request, RequestStatus
from kvserve.sampling_params import SamplingParams

EOS = 0


def make_request(req_id: str, prompt: list[int], max_tokens: int = 8, block_size: int = 4, **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    core_req = EngineCoreRequest(req_id, prompt, sp, frozenset({EOS}), arrival_time=0.0, max_tokens=max_tokens)
    return Request(core_req, block_size=block_size)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    async_scheduling: bool = False,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            enable_chunked_prefill,
            async_scheduling=async_scheduling,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
    )


class FakeRunner:
    """Mirrors what the real runner does with a SchedulerOutput, with a 'model' whose next token is a pure
    function of the whole token history, so any scheduling mistake (lost, repeated or reordered context)
    changes the output."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.computed.pop(req_id, None)
            self.block_ids.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.tokens
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.block_ids[new.req_id] = list(new.block_ids)
        for cached in so.scheduled_cached_reqs:
            assert self.computed[cached.req_id] == cached.num_computed_tokens
            self.block_ids[cached.req_id].extend(cached.new_block_ids)
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            self.computed[req_id] += n
            toks = self.tokens[req_id]
            assert self.computed[req_id] <= len(toks)
            req_ids.append(req_id)
            if self.computed[req_id] == len(toks):
                nxt = next_token(toks)
                toks.append(nxt)
                sampled.append([nxt])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled)


def next_token(history: list[int]) -> int:
    h = 0
    for t in history:
        h = (h * 31 + t + 7) % 1_000_003
    return 1 + h % 997  # never EOS


def run_to_completion(
    scheduler: Scheduler, requests: list[Request], max_steps: int = 10_000
) -> tuple[dict[str, list[int]], list[SchedulerOutput]]:
    for r in requests:
        scheduler.add_request(r)
    runner = FakeRunner()
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    history: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        history.append(so)
        assert so.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        ro = runner.execute(so)
        out: EngineCoreOutput
        for out in scheduler.update_from_output(so, ro):
            outputs[out.request_id].extend(out.new_token_ids)
    else:
        raise AssertionError("requests did not finish")
    return outputs, history


def run_async_to_completion(
    scheduler: Scheduler, requests: list[Request], abort: dict[int, list[str]] | None = None, max_steps: int = 10_000
) -> dict[str, list[int]]:
    """The engine core's async loop: step N+1 is scheduled (and run) before step N's output updates the scheduler.
    The fake runner computes at once but its output is handed over one step late. `abort`: step -> request ids
    aborted just before that step is scheduled."""
    assert scheduler.async_scheduling
    for r in requests:
        scheduler.add_request(r)
    runner = FakeRunner()
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    in_flight = None
    for step in range(max_steps):
        if in_flight is None and not scheduler.has_unfinished_requests():
            break
        if abort and step in abort:
            scheduler.finish_requests(abort[step], RequestStatus.FINISHED_ABORTED)
        so = scheduler.schedule()
        assert so.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        ro = runner.execute(so)  # an empty step still tells the runner what to forget
        previous, in_flight = in_flight, (None if so.is_empty else (so, ro))
        if previous is not None:
            for out in scheduler.update_from_output(*previous):
                outputs[out.request_id].extend(out.new_token_ids)
    else:
        raise AssertionError("requests did not finish")
    return outputs


def preempted_per_step(history: list[SchedulerOutput]) -> list[set[str]]:
    """The requests each step preempted: the runner is told to drop them, and they are sent in full again later
    (a finished request never comes back)."""
    return [
        so.finished_req_ids & {new.req_id for later in history[k + 1 :] for new in later.scheduled_new_reqs}
        for k, so in enumerate(history)
    ]


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks))
    return toks[len(prompt) :]


def assert_no_leak(scheduler: Scheduler) -> None:
    pool = scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert scheduler.kv.req_to_blocks == {}
    assert scheduler.requests == {}
