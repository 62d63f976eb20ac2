"""EngineCore: the schedule -> execute -> update loop. No I/O; the frontend or a process wrapper drives it."""

from __future__ import annotations

import logging
from dataclasses import asdict, replace

from kvserve.config import EngineConfig
from kvserve.core.scheduler import Scheduler
from kvserve.core.spec_decode import SpecDecodingStats
from kvserve.engine.messages import CoreStats
from kvserve.kv_transfer.factory import create_scheduler_connector
from kvserve.outputs import EngineCoreOutput
from kvserve.profiling import StepTimer
from kvserve.request import EngineCoreRequest, Request, RequestStatus
from kvserve.threads import apply_thread_plan, plan_threads
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Before the model loads: its weight packing and every step run on the plan's threads.
        apply_thread_plan(config.threads or plan_threads())
        self.timer = StepTimer()  # enable to account step time by phase (benchmarks)
        self.runner = ModelRunner(
            config.model, config.cache, config.scheduler, self.timer, config.speculative, config.kv_transfer
        )
        connector = None
        if config.kv_transfer is not None:
            connector = create_scheduler_connector(config.kv_transfer, self.runner.kv_connector_info)
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            self.runner.num_blocks,
            config.speculative,
            connector=connector,
            num_swap_blocks=self.runner.num_swap_blocks,
        )

    @property
    def max_tokens_per_request(self) -> int:
        return self.scheduler.max_tokens_per_request

    def add_request(self, core_req: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(core_req, self.config.cache.block_size))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        timer = self.timer
        timer.steps += 1
        with timer.phase("schedule"):
            scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        with timer.phase("update"):
            return self.scheduler.update_from_output(scheduler_output, runner_output)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

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

    def shutdown(self) -> None:
        """Stop the runner's background work (the KV-pool prefault thread). Idempotent."""
        self.runner.shutdown()
