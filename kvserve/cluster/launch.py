"""`kvserve cluster`: a whole local cluster in one command, for a new user and for the benchmarks.

    kvserve cluster --instances 2                    # router on :8080, the embedded model, a shared pool

It starts, in order, each as a child process: the global index's Valkey server; with a pool, Mooncake's master and
a storage node (or a Valkey server holding the block bytes with `--pool valkey`); N `kvserve serve` instances,
each publishing its KV events and (with a pool) chained to it through the pool connector, each pinned to its own
CPUs when there are enough (`taskset`); and `kvserve router` over them. Ctrl-C (or SIGTERM) stops them all, in
reverse order. docs/distributed.md shows the same pieces on several hosts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

import httpx

from kvserve.cluster.process import Service, free_port

logger = logging.getLogger(__name__)


@dataclass
class ClusterConfig:
    num_instances: int = 2
    model: str | None = None  # None: the embedded default model
    pool: str = "mooncake"  # "mooncake" | "valkey" | "none"
    pool_bytes: str = "1 GB"  # the storage node's memory (mooncake) or Valkey's maxmemory
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    router_port: int = 8080
    pin: bool = True  # each instance on its own CPUs, when the machine has at least one per instance
    serve_args: list[str] = field(default_factory=list)  # more `kvserve serve` flags for every instance
    startup_timeout_s: float = 600.0
    router: bool = True


class LocalCluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.services: list[Service] = []
        self.instance_urls: list[str] = []
        self.index_url = ""
        self.pool_config: dict | None = None
        self.router_url = f"http://{config.host}:{config.router_port}"

    # ------------------------------------------------------------------ start

    def start(self) -> LocalCluster:
        try:
            self._start_index()
            self._start_pool()
            self._start_instances()
            if self.config.router:
                self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_index(self) -> None:
        from kvserve.cluster.valkey import ValkeyService

        index = ValkeyService(self.config.host)
        self.services.append(index)
        self.index_url = index.url

    def _start_pool(self) -> None:
        c = self.config
        if c.pool == "none":
            return
        if c.pool == "valkey":
            from kvserve.cluster.valkey import ValkeyService

            store = ValkeyService(c.host, maxmemory=c.pool_bytes.replace(" ", "").lower())
            self.services.append(store)
            self.pool_config = {"kv_connector": "pool", "store": "valkey", "url": store.url}
            return
        from kvserve.cluster.mooncake import MooncakeMaster, MooncakeStorageNode

        master = MooncakeMaster(c.host)
        self.services.append(master)
        self.services.append(MooncakeStorageNode(master.address, c.host, segment=c.pool_bytes))
        self.pool_config = {"kv_connector": "pool", "store": "mooncake", "master": master.address}

    def instance_argv(self, i: int, port: int) -> list[str]:
        c = self.config
        argv = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--host", c.host, "--port", str(port)]
        if c.model:
            argv += ["--model", c.model]
        events = {
            "endpoint": f"tcp://{c.host}:{free_port(c.host)}",
            "replay_endpoint": f"tcp://{c.host}:{free_port(c.host)}",
        }
        argv += ["--kv-events-config", json.dumps(events)]
        if self.pool_config is not None:
            argv += ["--kv-transfer-config", json.dumps(self.pool_config)]
        argv += c.serve_args
        cpus = sorted(os.sched_getaffinity(0))
        if c.pin and len(cpus) >= c.num_instances and shutil.which("taskset"):
            per = len(cpus) // c.num_instances
            mine = cpus[i * per : (i + 1) * per]
            argv = ["taskset", "-c", ",".join(map(str, mine)), *argv]
        return argv

    def _start_instances(self) -> None:
        for i in range(self.config.num_instances):
            port = free_port(self.config.host)
            self.services.append(Service(f"instance{i}", self.instance_argv(i, port)))
            self.instance_urls.append(f"http://{self.config.host}:{port}")
        deadline = time.monotonic() + self.config.startup_timeout_s
        for url, service in zip(self.instance_urls, self.services[-len(self.instance_urls) :], strict=True):
            _wait_healthy(url, service, deadline)

    def _start_router(self) -> None:
        c = self.config
        argv = [sys.executable, "-m", "kvserve.entrypoints.cli", "router", "--host", c.host]
        argv += ["--port", str(c.router_port), "--policy", c.policy, "--index-url", self.index_url]
        if c.model:
            argv += ["--model", c.model]
        for url in self.instance_urls:
            argv += ["--instance", url]
        router = Service("router", argv)
        self.services.append(router)
        _wait_healthy(self.router_url, router, time.monotonic() + 120)

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()
        self.services = []

    def describe(self) -> str:
        lines = [f"router      {self.router_url}  (policy {self.config.policy})"]
        lines += [f"instance {i}  {url}" for i, url in enumerate(self.instance_urls)]
        lines.append(f"index       {self.index_url}")
        if self.pool_config is not None:
            where = self.pool_config.get("master") or self.pool_config.get("url")
            lines.append(f"pool        {self.pool_config['store']} at {where}")
        lines += [f"logs        {s.name}: {s.log_path}" for s in self.services]
        return "\n".join(lines)


def _wait_healthy(url: str, service: Service, deadline: float) -> None:
    while time.monotonic() < deadline:
        if not service.alive():
            raise RuntimeError(f"{service.name} exited during start-up:\n{service.log()}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{service.name} at {url} did not become healthy:\n{service.log()}")


def run_cluster(config: ClusterConfig) -> int:
    """Start everything, print where it is, and wait for Ctrl-C / SIGTERM (or a service dying)."""
    cluster = LocalCluster(config)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        cluster.start()
        print(cluster.describe(), flush=True)
        print("ready: send OpenAI requests to the router; Ctrl-C stops the cluster", flush=True)
        while all(s.alive() for s in cluster.services):
            time.sleep(1.0)
        dead = [s.name for s in cluster.services if not s.alive()]
        print(f"stopping: {', '.join(dead)} exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
