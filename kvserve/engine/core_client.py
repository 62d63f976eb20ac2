"""Frontend end of the link to the engine-core process (asyncio + ZMQ)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import shutil
import tempfile
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvserve.config import EngineConfig
from kvserve.engine.core_proc import run_engine_core
from kvserve.engine.messages import (
    AbortRequests,
    AddRequest,
    FromCore,
    Ready,
    Shutdown,
    encoder,
    from_core_decoder,
)
from kvserve.request import EngineCoreRequest
from kvserve.threads import child_env, plan_threads

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process has exited; no request can complete."""


class AsyncMPClient:
    """Spawns the engine core, binds the two sockets it connects to, and watches the process for death."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._dir = tempfile.mkdtemp(prefix="kvserve-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.LINGER, 0)
        input_addr, output_addr = f"ipc://{self._dir}/to-core", f"ipc://{self._dir}/from-core"
        self._to_core.bind(input_addr)
        self._from_core.bind(output_addr)
        # spawn, not fork: the frontend may already run an event loop and threads.
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(
            target=run_engine_core,
            args=(
                config,
                input_addr,
                output_addr,
                logging.getLogger("kvserve").getEffectiveLevel(),
                logging.getLogger("kvserve.startup").getEffectiveLevel(),
            ),
            name="kvserve-engine-core",
            daemon=True,
        )
        # The core's torch reads its thread count and OpenMP wait policy from the environment it starts with.
        with child_env(config.threads or plan_threads(serving=True)):
            self.proc.start()
        self._death_callbacks: list[Callable[[], None]] = []
        self.dead = False

    async def wait_ready(self, timeout: float = 900.0) -> Ready:
        """Wait for the core to load the model; raises EngineDeadError if it dies first."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.proc.sentinel, self._on_exit)
        deadline = loop.time() + timeout
        while True:
            if self.dead:
                raise EngineDeadError(f"engine core exited during start-up (exit code {self.proc.exitcode})")
            if await self._from_core.poll(timeout=200):
                msg = from_core_decoder.decode(await self._from_core.recv())
                if isinstance(msg, Ready):
                    return msg
            if loop.time() > deadline:
                raise EngineDeadError("engine core did not become ready in time")

    def on_death(self, callback: Callable[[], None]) -> None:
        self._death_callbacks.append(callback)

    def _on_exit(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        if self.dead:
            return
        self.dead = True
        self.proc.join(timeout=1.0)  # the sentinel fires at exit; reaping may take a moment
        logger.error("engine core process exited (exit code %s)", self.proc.exitcode)
        for cb in self._death_callbacks:
            cb()

    async def add_request(self, request: EngineCoreRequest) -> None:
        if self.dead:
            raise EngineDeadError("engine core is not running")
        await self._to_core.send(encoder.encode(AddRequest(request)))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Fire and forget; safe to call from synchronous cleanup code (e.g. a cancelled generator)."""
        if request_ids and not self.dead:
            self._to_core.send(encoder.encode(AbortRequests(request_ids)))

    async def get_output(self) -> FromCore:
        return from_core_decoder.decode(await self._from_core.recv())

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the core to stop, then make sure it has: terminate, and kill as a last resort."""
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self._to_core.send(encoder.encode(Shutdown()))
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.dead = True
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
