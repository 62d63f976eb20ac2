"""Network namespaces for tests whose traffic must really cross an interface (we run as root, CI too).

`veth_pair()` makes two namespaces joined by a veth pair (10.<n>.0.1 and 10.<n>.0.2, loopback up in each), yields
them, and on exit kills whatever still runs inside and deletes both. Start a process in one with
`Namespace.cmd(argv)`. A machine without `ip netns` (or without root) skips the test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass
class Namespace:
    name: str
    ip: str
    dev: str

    def cmd(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def bytes_received(self) -> int:
        out = subprocess.run(self.cmd(["cat", f"/sys/class/net/{self.dev}/statistics/rx_bytes"]), capture_output=True)
        return int(out.stdout)


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], check=check, capture_output=True, text=True)


def netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"kvprobe{os.getpid()}"
    ok = _ip("netns", "add", name, check=False).returncode == 0
    _ip("netns", "del", name, check=False)
    return ok


def _kill_inside(name: str) -> None:
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.time() + 5
    while pids and time.time() < deadline:
        time.sleep(0.05)
        pids = _ip("netns", "pids", name, check=False).stdout.split()


@contextlib.contextmanager
def veth_pair(tag: str = "kv") -> Iterator[tuple[Namespace, Namespace]]:
    if not netns_available():
        pytest.skip("needs root and `ip netns`")
    n = os.getpid() % 200 + 20
    a = Namespace(f"{tag}{n}a", f"10.{n}.0.1", f"{tag}{n}va")
    b = Namespace(f"{tag}{n}b", f"10.{n}.0.2", f"{tag}{n}vb")
    for ns in (a, b):
        _kill_inside(ns.name)
        _ip("netns", "del", ns.name, check=False)
    try:
        for ns in (a, b):
            _ip("netns", "add", ns.name)
        _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for ns in (a, b):
            _ip("link", "set", ns.dev, "netns", ns.name)
            _ip("-n", ns.name, "addr", "add", f"{ns.ip}/24", "dev", ns.dev)
            _ip("-n", ns.name, "link", "set", ns.dev, "up")
            _ip("-n", ns.name, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            _kill_inside(ns.name)
            _ip("netns", "del", ns.name, check=False)
