"""EngineCore: the schedule -> execute -> update loop. No I/O; the frontend or a process wrapper drives it.

Start-up: the executor's workers load the model and describe their KV cache (a KVCacheSpec, merged over the
tensor-parallel ranks); the core sizes the pool and the swap space from it, has the workers allocate both with
their connector sides, and builds the scheduler and the connector's scheduler side from the same spec. It never
reaches into a worker's runner.

With async scheduling a step schedules and launches step N+1, then updates from step N's output: the scheduler
runs while the device still computes, and each step's outputs come one call later.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace

from kvserve.config import EngineConfig
from kvserve.core.kv_events import KVEventBatch
from kvserve.core.sched_output import SchedulerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.core.spec_policy import SpecDecodingStats
from kvserve.engine.combinations import check_request
from kvserve.engine.messages import CoreStats
from kvserve.executor.base import get_executor_class
from kvserve.kv_transfer.factory import create_scheduler_connector
from kvserve.outputs import EngineCoreOutput
from kvserve.profiling import StepTimer
from kvserve.request import EngineCoreRequest, Request, RequestStatus
from kvserve.structured_output.matcher import StructuredOutputManager
from kvserve.thread_adapt import ThreadAdapter
from kvserve.threads import affinity_cpus, apply_thread_plan, plan_threads

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Before the model loads: its weight packing and every step run on the plan's threads.
        plan = config.threads or plan_threads()
        apply_thread_plan(plan)
        # One rank in this process: its threads follow the CPUs other processes leave free (tensor-parallel ranks
        # keep their fixed, pinned shares).
        adapt = plan.adapt and config.parallel.tensor_parallel_size == 1
        self.thread_adapter = ThreadAdapter(affinity_cpus(), plan.num_threads) if adapt else None
        self.timer = StepTimer()  # enable to account step time by phase (benchmarks)
        # The workers (one per tensor-parallel rank) load the model; the KV pool is what every rank can hold.
        self.executor = get_executor_class(config.parallel)(config, self.timer)
        connector = None
        try:
            self.kv_cache_spec = self.executor.get_kv_cache_spec()
            self.num_blocks = self.executor.determine_num_kv_blocks()
            # The swap budget pays for every rank's slice of a block (and a draft's pool, which moves with it).
            num_swap_blocks = config.cache.swap_space // self.kv_cache_spec.block_bytes
            self.executor.initialize_kv_cache(self.num_blocks, num_swap_blocks, self.kv_cache_spec)
            if config.kv_transfer is not None:
                connector = create_scheduler_connector(config.kv_transfer, self.kv_cache_spec)
                connector.set_handshake_metadata(self.executor.get_handshake_metadata())
        except BaseException:
            self.executor.shutdown()
            raise
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight: SchedulerOutput | None = None  # async: the launched step whose output is not back
        self.structured_output = StructuredOutputManager(config.model.tokenizer, config.model.arch.vocab_size)
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            self.num_blocks,
            config.speculative,
            connector=connector,
            num_swap_blocks=num_swap_blocks,
            structured_output=self.structured_output,
            enable_kv_events=config.kv_events is not None,
            sliding_window=self.kv_cache_spec.freeable_window,
        )

    @property
    def max_tokens_per_request(self) -> int:
        return self.scheduler.max_tokens_per_request

    def add_request(self, core_req: EngineCoreRequest) -> None:
        check_request(self.config, core_req.sampling_params)
        request = Request(core_req, self.config.cache.block_size)
        constraint = core_req.sampling_params.structured_outputs
        if constraint is not None:
            request.grammar = self.structured_output.new_grammar(constraint, core_req.eos_token_ids)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.has_unfinished_requests():
            return []
        if self.thread_adapter is not None:
            num_threads = self.thread_adapter.poll()
            if num_threads is not None:
                self.executor.collective_rpc("set_num_threads", (num_threads,))
        timer = self.timer
        timer.steps += 1
        drained: list[EngineCoreOutput] = []
        synchronous = not self.async_scheduling
        if not synchronous and self.scheduler.has_structured_output_requests():
            # A constrained request's next mask needs its last token: finish the step in flight, then run this
            # step synchronously (async steps resume once no constrained request is left).
            drained, synchronous = self._drain_in_flight(), True
        with timer.phase("schedule"):
            scheduler_output = self.scheduler.schedule()
        if not synchronous:
            return self._step_async(scheduler_output)
        runner_output = self.executor.execute_model(scheduler_output)
        if self.async_scheduling:
            # The runner launched the step without waiting for it (nothing else was in flight): collect it now.
            assert runner_output is None, "a step was in flight beside a synchronous one"
            runner_output = self.executor.execute_model(SchedulerOutput())
        assert runner_output is not None
        with timer.phase("update"):
            return drained + self.scheduler.update_from_output(scheduler_output, runner_output)

    def _drain_in_flight(self) -> list[EngineCoreOutput]:
        """Async scheduling: the outputs of the step in flight, launching nothing after it."""
        previous, self._in_flight = self._in_flight, None
        if previous is None:
            return []
        runner_output = self.executor.execute_model(SchedulerOutput())
        assert runner_output is not None, "the runner lost the step in flight"
        with self.timer.phase("update"):
            return self.scheduler.update_from_output(previous, runner_output)

    def _step_async(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        previous, self._in_flight = self._in_flight, None if scheduler_output.is_empty else scheduler_output
        runner_output = self.executor.execute_model(scheduler_output)
        if previous is None:
            assert runner_output is None, "the runner returned an output for no step"
            return []
        assert runner_output is not None, "the runner lost the step in flight"
        with self.timer.phase("update"):
            return self.scheduler.update_from_output(previous, runner_output)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def take_kv_events(self) -> KVEventBatch | None:
        """The KV events of the steps since the last call (the pool's and the connector's), or None when there
        are none or events are off; the engine-core process publishes them."""
        events = self.scheduler.take_kv_events()
        return KVEventBatch(time.time(), events) if events else None

    def make_stats(self) -> CoreStats:
        """KV usage, scheduler queues and prefix-cache counters as plain values (the one place they are built)."""
        return CoreStats(
            **asdict(self.scheduler.make_stats()),
            block_size=self.config.cache.block_size,
            prefix_cache=replace(self.scheduler.kv.stats),
            spec_decoding=self._spec_stats(),
            kv_transfer=self.scheduler.connector.stats() if self.scheduler.connector is not None else None,
        )

    def _spec_stats(self) -> SpecDecodingStats | None:
        if self.config.speculative is None:
            return None
        stats = self.scheduler.spec_stats
        return replace(stats, num_accepted_tokens_per_pos=list(stats.num_accepted_tokens_per_pos))

    def get_stats(self) -> dict:
        return self.make_stats().to_dict()

    def check_health(self) -> None:
        """Raises executor.base.WorkerFailedError if a worker is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the workers (and the runners' KV-pool prefault threads), the connector's scheduler side and the
        grammar compiler. Idempotent."""
        self.structured_output.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
        self.executor.shutdown()
