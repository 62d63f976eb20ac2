"""Executor: the engine core's one handle on its workers (one per tensor-parallel rank), wherever they run.

The engine core calls `execute_model` once per step with the step's SchedulerOutput, and start-up and
maintenance methods through `collective_rpc`, which runs a Worker method on every rank and returns the results
in rank order. Implementations: `uniproc` (one worker in this process), `mp` (worker processes on this machine),
`ray` (Ray actors, on this machine or a cluster); `get_executor_class` picks one from ParallelConfig.

Failure contract: a worker that dies, raises, or does not answer within `worker_timeout_s` makes the call raise
WorkerFailedError, and the executor stays failed (every later call raises it too). The engine core lets it end
the engine; its owner then reports the engine dead. `shutdown` never blocks on a failed worker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kvserve.config import EngineConfig, ParallelConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.outputs import ModelRunnerOutput


class WorkerFailedError(RuntimeError):
    """A worker died, hung past the timeout, or raised; the engine cannot continue."""


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.parallel = config.parallel
        self.failure: str | None = None  # set once a worker failed

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        """Call `Worker.<method>(*args)` on every rank; the results in rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank (the SchedulerOutput sent once to each); the driver's output."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Async scheduling: launch this step and return the output of the step launched before it (None when
        there was none). Only where the runner is in this process (the engine's options check it)."""
        raise NotImplementedError(f"async scheduling needs the uniproc executor, not {type(self).__name__}")

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers; idempotent, bounded even when a worker hangs."""

    def determine_num_kv_blocks(self) -> int:
        """The pool every rank can hold: the minimum over the workers."""
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def check_health(self) -> None:
        """Raises WorkerFailedError if a worker is gone or does not answer."""
        self.collective_rpc("check_health", timeout=min(10.0, self.parallel.worker_timeout_s))

    @property
    def driver_runner(self):
        """The rank-0 ModelRunner, for in-process tools (benchmarks, perplexity); only the uniproc executor has
        one in this process."""
        raise RuntimeError(
            f"the model runs in {self.parallel.distributed_executor_backend} workers, not in this process"
        )

    def _fail(self, message: str) -> WorkerFailedError:
        if self.failure is None:
            self.failure = message
        return WorkerFailedError(self.failure)


def get_executor_class(parallel: ParallelConfig) -> type[Executor]:
    backend = parallel.distributed_executor_backend
    if backend == "uniproc":
        from kvserve.executor.uniproc import UniprocExecutor

        return UniprocExecutor
    if backend == "mp":
        from kvserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from kvserve.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(f"unknown distributed_executor_backend {backend!r}")
