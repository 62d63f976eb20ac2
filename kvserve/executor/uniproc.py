"""The uniproc executor: the one worker in the engine core's own process (TP=1), called directly."""

from __future__ import annotations

from typing import Any

from kvserve.config import EngineConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.executor.base import Executor
from kvserve.outputs import ModelRunnerOutput
from kvserve.profiling import StepTimer
from kvserve.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, timer: StepTimer | None = None) -> None:
        super().__init__(config)
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("the uniproc executor runs tensor_parallel_size 1 only; use mp or ray")
        # The engine core has applied the thread plan to this process already.
        self.worker = Worker(config, rank=0)
        self.worker.init_device(None)
        self.worker.load_model(timer)

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self._combine([self.worker.execute_model(scheduler_output)])

    def check_health(self) -> None:
        pass  # it is this process

    def shutdown(self) -> None:
        self.worker.shutdown()

    @property
    def driver_runner(self):
        return self.worker.runner
