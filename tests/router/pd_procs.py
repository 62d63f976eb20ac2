"""Real processes for the router's PD mode: `kvserve serve` with the pd connector (optionally inside a network
namespace, tests/netns.py), and helpers that read an instance's state from its /metrics."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

from tests.entrypoints.openai.server_utils import Server, free_port
from tests.netns import Namespace
from tests.router.procs import RouterProc

T = TypeVar("T")


def pd_transfer_config(role: str, host: str = "127.0.0.1", **options) -> str:
    return json.dumps({"kv_connector": "pd", "kv_role": role, "side_channel_host": host, **options})


def pd_server(model: str, role: str, *args: str, wait: bool = True, **options) -> Server:
    return Server(model, *args, "--kv-transfer-config", pd_transfer_config(role, **options), wait=wait)


def metric(text: str, name: str, **labels: str) -> float:
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        sample = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(sample.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    assert found, f"metric {name} {labels} not found"
    return total


def transfer_stat(text: str, stat: str) -> float:
    return metric(text, "kvserve:kv_transfer", stat=stat)


def wait_kv_free(get_metrics: Callable[[], str], timeout: float = 30.0) -> None:
    """Until the instance reports no KV block held (its leases ended, its requests gone)."""
    deadline = time.time() + timeout
    usage = None
    while time.time() < deadline:
        usage = metric(get_metrics(), "kvserve:kv_cache_usage_perc")
        if usage == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"KV usage still {usage} after {timeout} s")


# ---------------------------------------------------------------------------------------------- network namespaces

_CLONE_NEWNET = 0x40000000


def in_netns(ns: Namespace, fn: Callable[[], T]) -> T:
    """Run `fn` on a thread that has entered `ns`'s network namespace (sockets it opens live there)."""
    result: dict = {}

    def run() -> None:
        try:
            fd = os.open(f"/var/run/netns/{ns.name}", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            result["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


class NetnsProc:
    """A kvserve CLI process inside a namespace, bound to its address; HTTP to it goes through `in_netns`."""

    def __init__(
        self, ns: Namespace, argv: list[str], name: str, startup_timeout: float = 300, wait: bool = True
    ) -> None:
        """With wait=False it returns at once; `wait_healthy` (or server_utils.all_healthy) waits."""
        self.ns = ns
        self.name = name
        self.port = free_port()
        self.url = f"http://{ns.ip}:{self.port}"
        self.log_path = f"/tmp/kvserve-test-{name}-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", *argv, "--host", ns.ip, "--port", str(self.port)]
        self.proc = subprocess.Popen(ns.cmd(cmd), stdout=self._log, stderr=subprocess.STDOUT)
        self._deadline = time.time() + startup_timeout
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> NetnsProc:
        while time.time() < self._deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited during start-up:\n{self.log()}")
            if self.get("/health", timeout=1) == 200:
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not become healthy:\n{self.log()}")

    def get(self, path: str, timeout: float = 10) -> int | None:
        def probe() -> int | None:
            try:
                return httpx.get(f"{self.url}{path}", timeout=timeout).status_code
            except httpx.HTTPError:
                return None

        return in_netns(self.ns, probe)

    def text(self, path: str) -> str:
        return in_netns(self.ns, lambda: httpx.get(f"{self.url}{path}", timeout=10).text)

    def post(self, path: str, body: dict, timeout: float = 120) -> httpx.Response:
        return in_netns(self.ns, lambda: httpx.post(f"{self.url}{path}", json=body, timeout=timeout))

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def pd_router(prefill: list[str], decode: list[str], *extra: str) -> RouterProc:
    return RouterProc(
        [], *[a for u in prefill for a in ("--prefill", u)], *[a for u in decode for a in ("--decode", u)], *extra
    )
