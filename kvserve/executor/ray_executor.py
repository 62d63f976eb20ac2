"""The ray executor: one Ray actor per tensor-parallel rank, on this machine or anywhere in a Ray cluster.

The engine joins the Ray cluster this process is connected to (`ray.init` done by the caller), else the one
RAY_ADDRESS names, else starts a local one. Rank 0's node and a free port there are the gloo rendezvous. Each step
puts the SchedulerOutput into Ray's object store once and every actor reads that one object.

Across machines (docs/architecture.md, "Executors"): `ray start --head` on the first machine, `ray start
--address=<head>:6379` on the others, then `RAY_ADDRESS=<head>:6379 kvserve serve --tensor-parallel-size N
--distributed-executor-backend ray` on the head. Every machine needs kvserve and the model at the same path, and
the ranks must reach each other over TCP (gloo; GLOO_SOCKET_IFNAME picks the interface).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from kvserve.config import EngineConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.executor.base import Executor
from kvserve.outputs import ModelRunnerOutput
from kvserve.threads import ThreadPlan, engine_env, plan_threads, rank_thread_plan

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 900.0


class RayWorkerWrapper:
    """The actor: a Worker plus what the executor needs to know about where it runs."""

    def __init__(self, config: EngineConfig, rank: int, thread_plan: ThreadPlan) -> None:
        from kvserve.worker.worker import Worker

        self.worker = Worker(config, rank, thread_plan)

    def rendezvous_address(self) -> str:
        import ray

        from kvserve.process_utils import free_port

        ip = ray.util.get_node_ip_address()
        return f"tcp://{ip}:{free_port(ip)}"

    def pid(self) -> int:
        import os

        return os.getpid()

    def execute_method(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, timer=None) -> None:
        """`timer` is unused: step phases are timed inside the actors."""
        super().__init__(config)
        import ray

        self._ray = ray
        if not ray.is_initialized():
            ray.init()  # RAY_ADDRESS's cluster if set, else a local one
        self.world_size = config.parallel.tensor_parallel_size
        plan = config.threads or plan_threads()
        actor_cls = ray.remote(RayWorkerWrapper)
        self.actors = []
        for rank in range(self.world_size):
            # Ray places the actors; CPU pinning is left to the user (--cpu-bind) since the nodes may differ.
            rank_plan = replace(rank_thread_plan(plan, rank, self.world_size), cpu_bind=None)
            actor = actor_cls.options(
                name=None,
                num_cpus=rank_plan.num_threads,
                runtime_env={"env_vars": engine_env(rank_plan)},
            ).remote(config, rank, rank_plan)
            self.actors.append(actor)
        try:
            self.pids = self._get([a.pid.remote() for a in self.actors], _STARTUP_TIMEOUT_S, "start-up")
            (init_method,) = self._get([self.actors[0].rendezvous_address.remote()], _STARTUP_TIMEOUT_S, "start-up")
            self.collective_rpc("init_device", (init_method,), timeout=_STARTUP_TIMEOUT_S)
            self.collective_rpc("load_model", timeout=_STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        if self.failure is not None:
            raise self._fail(self.failure)
        refs = [a.execute_method.remote(method, *args) for a in self.actors]
        return self._get(refs, timeout, method)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.failure is not None:
            raise self._fail(self.failure)
        so_ref = self._ray.put(scheduler_output)  # serialized once, read by every actor
        refs = [a.execute_method.remote("execute_model", so_ref) for a in self.actors]
        return self._combine(self._get(refs, None, "execute_model"))

    def _get(self, refs: list, timeout: float | None, what: str) -> list[Any]:
        """Results in rank order; the first failure (in completion order, so a dead rank is reported even while
        its peers wait in a collective) or the timeout raises WorkerFailedError."""
        ray = self._ray
        timeout = self.parallel.worker_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        rank_of = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, remaining))
            if not ready:
                ranks = sorted(rank_of[r] for r in pending)
                raise self._fail(f"worker(s) {ranks} did not answer {what} in {timeout:g} s")
            for ref in ready:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise self._fail(f"worker {rank_of[ref]} (Ray actor) died during {what}: {e}") from None
                except ray.exceptions.RayTaskError as e:
                    raise self._fail(f"worker {rank_of[ref]} failed in {what}: {e}") from None
        return results

    def shutdown(self) -> None:
        for actor in getattr(self, "actors", []):
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception as e:  # an actor already gone
                logger.debug("ray.kill: %s", e)
        self.actors = []
