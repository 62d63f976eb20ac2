"""The router as the user runs it: `kvserve router` in a subprocess on a free loopback port."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from tests.entrypoints.openai.server_utils import free_port


class RouterProc:
    def __init__(self, instance_urls: list[str], *extra: str, startup_timeout: float = 120) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "router", "--port", str(self.port)]
        for u in instance_urls:
            cmd += ["--instance", u]
        cmd += ["--health-interval", "0.5", *extra]
        self.log_path = f"/tmp/kvserve-test-router-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited during start-up:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"router did not become healthy:\n{self.log()}")

    def instances(self) -> list[dict]:
        return httpx.get(f"{self.url}/router/instances", timeout=5).json()

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
