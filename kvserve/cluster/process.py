"""Child processes for the real distributed services (cluster/valkey.py, cluster/mooncake.py) and the cluster
launcher: each can run inside a network namespace (`netns`), logs to a file, and is stopped (or killed, to test
faults) by its owner; nothing outlives the process that started it unless that process is SIGKILLed."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(
    host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None, netns: str | None = None
) -> None:
    """Until a TCP connection to host:port succeeds (from inside `netns` when given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode} during start-up")
        if netns is None:
            try:
                with socket.create_connection((host, port), timeout=0.2):
                    return
            except OSError:
                pass
        else:
            code = f"import socket; socket.create_connection(({host!r}, {port}), timeout=0.2)"
            probe = ["ip", "netns", "exec", netns, "python3", "-c", code]
            if subprocess.run(probe, capture_output=True).returncode == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{host}:{port} not accepting connections after {timeout_s} s")


class Service:
    """A child process with a log file; `stop()` is graceful, `kill()` is not (faults)."""

    def __init__(self, name: str, argv: list[str], env: dict | None = None, netns: str | None = None) -> None:
        self.name = name
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        fd, self.log_path = tempfile.mkstemp(prefix=f"kvserve-{name}-", suffix=".log")
        self._log = os.fdopen(fd, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
