"""Worker: one tensor-parallel rank. It owns the rank's threads, its place in the process group and its
ModelRunner; an executor drives it (in-process, in a worker process, or as a Ray actor) through plain method calls
whose arguments and results are plain values.

Every rank runs the same step on the same SchedulerOutput: the layers exchange activations with collectives,
every rank gets the full logits and samples the same tokens (same seeds, same generator), so each keeps its own
InputBatch in step with no further message. Only the driver (rank 0) returns its ModelRunnerOutput; with a KV
connector the other ranks return their connector report, which the executor aggregates.
"""

from __future__ import annotations

import logging
import os

from kvserve.config import EngineConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.host_memory import keep_freed_memory
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.outputs import ModelRunnerOutput
from kvserve.threads import ThreadPlan, apply_thread_plan, set_compute_threads

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int, thread_plan: ThreadPlan | None = None) -> None:
        self.config = config
        self.rank = rank
        self.world_size = config.parallel.tensor_parallel_size
        self.thread_plan = thread_plan
        self.runner = None

    def init_device(self, distributed_init_method: str | None) -> None:
        """Threads first (the weights are packed on them), then join the TP group (blocks until all ranks do)."""
        keep_freed_memory()
        if self.thread_plan is not None:
            apply_thread_plan(self.thread_plan)
        from kvserve.distributed.parallel_state import init_tensor_parallel

        init_tensor_parallel(
            self.rank,
            self.world_size,
            distributed_init_method or "",
            backend="gloo",
            timeout_s=self.config.parallel.worker_timeout_s,
        )

    def load_model(self, timer=None) -> None:
        from kvserve.worker.model_runner import ModelRunner

        c = self.config
        self.runner = ModelRunner(c.model, c.cache, c.scheduler, timer, c.speculative, c.kv_transfer)

    def set_num_threads(self, num_threads: int) -> None:
        """The engine's run-time thread adaptation (kvserve/thread_adapt.py): this rank's compute threads from the
        next step on."""
        set_compute_threads(num_threads)

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.runner.kv_cache_spec()

    def determine_num_kv_blocks(self) -> int:
        return self.runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int, spec: KVCacheSpec) -> None:
        self.runner.initialize_kv_cache(num_blocks, num_swap_blocks, spec)

    def get_handshake_metadata(self) -> dict | None:
        return self.runner.handshake_metadata()

    def prefault_kv_cache(self) -> None:
        self.runner.prefault_kv_cache()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The driver returns the step's output (with async scheduling: the previous step's, or None). The other
        ranks return only their KV connector's report, which the executor aggregates (None without one)."""
        output = self.runner.execute_model(scheduler_output)
        if self.rank == 0 or output is None or output.kv_connector_output is None:
            return output if self.rank == 0 else None
        return ModelRunnerOutput([], [], kv_connector_output=output.kv_connector_output)

    def check_health(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        """Stop the runner's background work. The process group is left to process exit: tearing it down could
        wait on a peer that is already gone."""
        if self.runner is not None:
            self.runner.shutdown()
