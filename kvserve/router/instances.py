"""The instances behind the router: where they are, whether they answer, and how much work each has from us.

Health: a background task asks every instance's `/health` every `health_interval_s`; `failures_to_drop`
failures in a row (or one connection error while proxying) take an instance out of rotation, and its requests in
flight are cancelled at once (they end with an error, not a hang); one success brings it back. Its
`/server_info` (block size, model, KV events endpoint) is read when it first answers.

Load: the router's own account of what it sent each instance and has not seen finish: prompt tokens still to be
prefilled (a request's count until its first output arrives) and requests decoding. `load_tokens` weighs a
decoding request like `decode_weight` prompt tokens (a decode step is far cheaper than prefilling a token).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)


@dataclass
class Instance:
    url: str  # http://host:port, no trailing slash
    healthy: bool = False
    info: dict = field(default_factory=dict)  # its /server_info, once read
    num_failures: int = 0
    last_change: float = field(default_factory=time.monotonic)
    # The router's account of its work there.
    prefill_tokens: int = 0
    num_decoding: int = 0
    num_in_flight: int = 0
    _cancels: set[Callable[[], None]] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.url.split("://", 1)[-1]

    def load_tokens(self, decode_weight: float) -> float:
        return self.prefill_tokens + decode_weight * self.num_decoding


class RequestTicket:
    """One proxied request's share of its instance's load; `first_output()` moves it from prefill to decode,
    `close()` releases it (idempotent)."""

    def __init__(self, instance: Instance, prompt_tokens: int, cancel: Callable[[], None]) -> None:
        self.instance = instance
        self.prompt_tokens = prompt_tokens
        self._cancel = cancel
        self._decoding = False
        self._closed = False
        instance.prefill_tokens += prompt_tokens
        instance.num_in_flight += 1
        instance._cancels.add(cancel)

    def first_output(self) -> None:
        if self._decoding or self._closed:
            return
        self._decoding = True
        self.instance.prefill_tokens -= self.prompt_tokens
        self.instance.num_decoding += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        inst = self.instance
        if self._decoding:
            inst.num_decoding -= 1
        else:
            inst.prefill_tokens -= self.prompt_tokens
        inst.num_in_flight -= 1
        inst._cancels.discard(self._cancel)


class InstanceSet:
    def __init__(
        self,
        urls: list[str],
        client: httpx.AsyncClient,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 1.0,
        failures_to_drop: int = 2,
    ) -> None:
        if not urls:
            raise ValueError("the router needs at least one instance URL")
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self.client = client
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.failures_to_drop = failures_to_drop
        self._task: asyncio.Task | None = None
        self._listeners: list[Callable[[Instance], None]] = []

    def on_change(self, listener: Callable[[Instance], None]) -> None:
        """`listener(instance)` runs whenever an instance goes in or out of rotation."""
        self._listeners.append(listener)

    @property
    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.healthy]

    async def start(self, wait_s: float = 0.0) -> None:
        """Check every instance once (waiting up to `wait_s` for at least one to answer), then keep checking."""
        deadline = time.monotonic() + wait_s
        await self.check_all()
        while not self.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(i) for i in self.instances))

    async def _check(self, inst: Instance) -> None:
        try:
            r = await self.client.get(f"{inst.url}/health", timeout=self.health_timeout_s)
            ok = r.status_code == 200
            if ok and not inst.info:
                info = await self.client.get(f"{inst.url}/server_info", timeout=self.health_timeout_s)
                inst.info = info.json() if info.status_code == 200 else {"unknown": True}
        except (httpx.HTTPError, ValueError):
            ok = False
        if ok:
            inst.num_failures = 0
            self._set(inst, True)
        else:
            inst.num_failures += 1
            if inst.num_failures >= self.failures_to_drop:
                self._set(inst, False)

    def mark_failed(self, inst: Instance, why: str) -> None:
        """A connection to it failed while proxying: out of rotation now (health checks bring it back)."""
        if inst.healthy:
            logger.warning("instance %s out of rotation: %s", inst.name, why)
        inst.num_failures = max(inst.num_failures, self.failures_to_drop)
        self._set(inst, False)

    def _set(self, inst: Instance, healthy: bool) -> None:
        if inst.healthy == healthy:
            return
        inst.healthy = healthy
        inst.last_change = time.monotonic()
        logger.info("instance %s %s", inst.name, "in rotation" if healthy else "out of rotation")
        if not healthy:
            for cancel in list(inst._cancels):
                cancel()
        for listener in self._listeners:
            listener(inst)
