"""Executor: the engine core's one handle on its workers (one per tensor-parallel rank), wherever they run.

The engine core calls `execute_model` once per step with the step's SchedulerOutput, and start-up and
maintenance methods through `collective_rpc`, which runs a Worker method on every rank and returns the results
in rank order. At start-up it learns the KV cache from the workers (`get_kv_cache_spec`: every rank's spec,
checked to agree and merged), sizes it (`determine_num_kv_blocks`), has every rank allocate it
(`initialize_kv_cache`) and gathers what their KV connectors publish (`get_handshake_metadata`); it never reaches
into a worker's runner. With a KV connector every rank reports each step, and `execute_model` returns the
driver's output with the ranks' connector reports aggregated (kv_transfer/aggregate.py).

Implementations: `uniproc` (one worker in this process), `mp` (worker processes on this machine), `ray` (Ray
actors, on this machine or a cluster); `get_executor_class` picks one from ParallelConfig.

Failure contract: a worker that dies, raises, or does not answer within `worker_timeout_s` makes the call raise
WorkerFailedError, and the executor stays failed (every later call raises it too). The engine core lets it end
the engine; its owner then reports the engine dead. `shutdown` never blocks on a failed worker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kvserve.config import EngineConfig, ParallelConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.aggregate import KVOutputAggregator
from kvserve.outputs import ModelRunnerOutput


class WorkerFailedError(RuntimeError):
    """A worker died, hung past the timeout, or raised; the engine cannot continue."""


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.parallel = config.parallel
        self.failure: str | None = None  # set once a worker failed
        # With a KV connector every rank answers each step with its report, combined here.
        self.kv_output_aggregator = (
            KVOutputAggregator(config.parallel.tensor_parallel_size) if config.kv_transfer is not None else None
        )

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        """Call `Worker.<method>(*args)` on every rank; the results in rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step on every rank (the SchedulerOutput sent once to each); the driver's output, with every
        rank's KV connector report aggregated. With async scheduling: the output of the step launched before this
        one (None when there was none)."""

    def _combine(self, outputs: list[ModelRunnerOutput | None]) -> ModelRunnerOutput | None:
        """The driver's output (rank 0 first) with the ranks' connector reports aggregated into it."""
        driver = outputs[0]
        if self.kv_output_aggregator is None or driver is None:
            return driver
        driver.kv_connector_output = self.kv_output_aggregator.aggregate(
            [None if o is None else o.kv_connector_output for o in outputs]
        )
        return driver

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers; idempotent, bounded even when a worker hangs."""

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """The engine's KV cache: every rank's spec, checked to agree (ValueError otherwise) and merged."""
        return KVCacheSpec.merge(self.collective_rpc("get_kv_cache_spec"))

    def determine_num_kv_blocks(self) -> int:
        """The pool every rank can hold: the minimum over the workers."""
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int, spec: KVCacheSpec) -> None:
        """Every rank allocates `num_blocks` blocks, `num_swap_blocks` swap blocks and its connector side."""
        self.collective_rpc("initialize_kv_cache", (num_blocks, num_swap_blocks, spec))

    def get_handshake_metadata(self) -> list[dict | None]:
        """What each rank's KV connector publishes (kv_transfer/base.py), in rank order."""
        return self.collective_rpc("get_handshake_metadata")

    def check_health(self) -> None:
        """Raises WorkerFailedError if a worker is gone or does not answer."""
        self.collective_rpc("check_health", timeout=min(10.0, self.parallel.worker_timeout_s))

    @property
    def driver_runner(self):
        """The rank-0 ModelRunner, for in-process tools and tests only (benchmarks, perplexity, EAGLE training);
        only the uniproc executor has one in this process. The engine itself never uses it
        (tests/test_layering.py)."""
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
