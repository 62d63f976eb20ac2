"""The mp executor: one worker process per tensor-parallel rank on this machine.

Each rank gets its share of the engine's CPUs (threads.rank_thread_plan) in its environment before its torch
starts, joins a gloo process group over loopback TCP, and then runs every step on the SchedulerOutput the executor
sends it over ZMQ (ipc sockets, encoded once per step). Waiting for an answer also watches every worker's process
sentinel, so a dead worker fails the step at once rather than when its peers' collectives time out.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle
import shutil
import tempfile
import time
import weakref
from typing import Any

import zmq

from kvserve.config import EngineConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.executor import wire
from kvserve.executor.base import Executor
from kvserve.executor.worker_proc import run_worker
from kvserve.outputs import ModelRunnerOutput
from kvserve.process_utils import free_port
from kvserve.threads import child_env, plan_threads, rank_thread_plan

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 900.0  # loading a model can take long on a busy machine


@contextlib.contextmanager
def _children_allowed():
    """multiprocessing refuses to start children from a daemonic process, which the serving engine core is. Our
    workers die with their parent anyway (PR_SET_PDEATHSIG) and are stopped by shutdown(), so lift the check
    while starting them."""
    cfg = multiprocessing.current_process()._config  # NOTE: private, but the only switch multiprocessing has
    was = cfg.get("daemon")
    cfg["daemon"] = False
    try:
        yield
    finally:
        cfg["daemon"] = was


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, timer=None) -> None:
        """`timer` is unused: step phases are timed inside the workers."""
        super().__init__(config)
        self.world_size = config.parallel.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="kvserve-workers-")
        self._ctx = zmq.Context()
        self._results = self._ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        results_addr = f"ipc://{self._dir}/results"
        self._results.bind(results_addr)
        self._to_workers: list[zmq.Socket] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self._closed = False
        plan = config.threads or plan_threads()
        mp = multiprocessing.get_context("spawn")
        log_level = logging.getLogger("kvserve").getEffectiveLevel()
        for rank in range(self.world_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            addr = f"ipc://{self._dir}/to-worker-{rank}"
            sock.bind(addr)
            self._to_workers.append(sock)
            rank_plan = rank_thread_plan(plan, rank, self.world_size)
            proc = mp.Process(
                target=run_worker,
                args=(config, rank, rank_plan, addr, results_addr, log_level),
                name=f"kvserve-worker-{rank}",
                daemon=True,
            )
            with _children_allowed(), child_env(rank_plan):
                proc.start()
            self.procs.append(proc)
        # An engine dropped without shutdown() (an offline LLM going out of scope) still ends its workers.
        self._finalizer = weakref.finalize(self, _kill, list(self.procs))
        self._poller = zmq.Poller()
        self._poller.register(self._results, zmq.POLLIN)
        for proc in self.procs:
            self._poller.register(proc.sentinel, zmq.POLLIN)
        try:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            self.collective_rpc("init_device", (init_method,), timeout=_STARTUP_TIMEOUT_S)
            self.collective_rpc("load_model", timeout=_STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------------ calls

    def collective_rpc(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        self._send(wire.RPC, pickle.dumps((method, args)))
        replies = self._wait(set(range(self.world_size)), timeout, what=method)
        return [pickle.loads(replies[r]) for r in range(self.world_size)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self._send(wire.STEP, wire.encoder.encode(scheduler_output))
        # Every rank answers when each reports its KV connector's work; else the driver alone.
        ranks = set(range(self.world_size)) if self.kv_output_aggregator is not None else {0}
        replies = self._wait(ranks, None, what="execute_model")
        return self._combine([wire.output_decoder.decode(replies[r]) for r in sorted(ranks)])

    def check_health(self) -> None:
        # The sentinels tell of a death without a round trip; a hung worker is caught by the step timeout.
        self._check_alive()

    def _send(self, kind: bytes, payload: bytes) -> None:
        if self.failure is not None:
            raise self._fail(self.failure)
        for sock in self._to_workers:
            sock.send_multipart([kind, payload], copy=False)

    def _wait(self, ranks: set[int], timeout: float | None, what: str) -> dict[int, bytes]:
        """Payloads of the OK answers of `ranks`; raises WorkerFailedError on an ERR answer, a death, or timeout."""
        timeout = self.parallel.worker_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        replies: dict[int, bytes] = {}
        while len(replies) < len(ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(f"worker(s) {sorted(ranks - set(replies))} did not answer {what} in {timeout:g} s")
            events = dict(self._poller.poll(min(remaining, 1.0) * 1000))
            if self._results in events:
                while True:
                    try:
                        rank, status, payload = self._results.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    r = int(rank)
                    if status == wire.ERR:
                        raise self._fail(f"worker {r} failed in {what}: {payload.decode(errors='replace')}")
                    replies[r] = payload
            if len(replies) < len(ranks):
                self._check_alive()
        return replies

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise self._fail(self.failure)
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise self._fail(f"worker {rank} (pid {proc.pid}) exited unexpectedly (exit code {proc.exitcode})")

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            for sock in self._to_workers:
                with contextlib.suppress(zmq.ZMQError):
                    sock.send_multipart([wire.STOP, b""], zmq.NOBLOCK)
            deadline = time.monotonic() + 5.0
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        # After a failure the others may be blocked in a collective and cannot act on SIGTERM: kill them at once.
        for proc in self.procs:
            if proc.is_alive():
                proc.kill() if self.failure is not None else proc.terminate()
        for proc in self.procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._finalizer.detach()
        for sock in [*self._to_workers, self._results]:
            sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _kill(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
