"""Run the real `kvserve serve` in a subprocess on a free loopback port."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on, never one this process handed out before: servers started side by side
    (all_healthy) have not bound theirs yet when the next one asks."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry))
    return children


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def all_gone(pids: list[int], timeout: float = 5.0) -> bool:
    """True once none of `pids` is alive (children exit right after their parent, not at the same instant)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return not any(pid_alive(p) for p in pids)


class Server:
    def __init__(self, model: str, *extra: str, startup_timeout: float = 300, wait: bool = True) -> None:
        """Starts `kvserve serve`; with wait=False it returns at once and `wait_healthy` (or `all_healthy`) waits."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "kvserve.entrypoints.cli",
            "serve",
            "--model",
            model,
            "--port",
            str(self.port),
            # The server prefaults its KV pool in the background; keep that pool small next to the other tests.
            "--kv-cache-memory",
            "512MiB",
            *extra,
        ]
        # KVSERVE_TEST_SPECULATIVE_CONFIG='{"method": "ngram", ...}' runs every server test with speculation on.
        spec = os.environ.get("KVSERVE_TEST_SPECULATIVE_CONFIG")
        if spec and "--speculative-config" not in extra:
            cmd += ["--speculative-config", spec]
        # KVSERVE_TEST_SERVE_ARGS='--tensor-parallel-size 2' runs every server test with those flags added.
        cmd += shlex.split(os.environ.get("KVSERVE_TEST_SERVE_ARGS", ""))
        self.log_path = f"/tmp/kvserve-test-server-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self._deadline = time.time() + startup_timeout
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> Server:
        deadline = self._deadline
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError(f"server did not become healthy:\n{self.log()}")
        self.engine_pids = child_pids(self.proc.pid)
        return self

    @property
    def engine_core_pid(self) -> int:
        """The spawned engine-core process (the other child is multiprocessing's resource tracker)."""
        for pid in self.engine_pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return pid
        raise AssertionError(f"no engine core among {self.engine_pids}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total, found = 0.0, False
        for line in self.metrics().splitlines():
            m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
            if not m or m.group(1) != name:
                continue
            sample_labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(sample_labels.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
                found = True
        assert found, f"metric {name} {labels} not found"
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def all_healthy(*servers):
    """Servers made with wait=False (Server, or anything with wait_healthy and stop), once every one is healthy:
    their start-ups overlap (a test of several instances waited for each in turn before). If one fails to start,
    all of them are stopped."""
    try:
        for server in servers:
            server.wait_healthy()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def start_two_long_requests(server: Server, model: str, wait_s: float = 10.0) -> tuple[list[threading.Thread], dict]:
    """A streaming and a blocking completion of 480 tokens each, in threads; returns once both are running (or after
    `wait_s`). The returned dict gets "stream" / "plain" = "completed" or the openai error each ended with, and
    "stream_t" / "plain_t" = when."""
    client = server.client(timeout=30)
    outcome: dict[str, object] = {}

    def streaming():
        try:
            for _ in client.completions.create(
                model=model,
                prompt="Tell me",
                max_tokens=480,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True},
            ):
                pass
            outcome["stream"] = "completed"
        except openai.APIError as e:
            outcome["stream"] = e
        outcome["stream_t"] = time.time()

    def blocking():
        try:
            client.completions.create(
                model=model, prompt=[7] * 20, max_tokens=480, temperature=0, extra_body={"ignore_eos": True}
            )
            outcome["plain"] = "completed"
        except openai.APIStatusError as e:
            outcome["plain"] = e
        outcome["plain_t"] = time.time()

    threads = [threading.Thread(target=streaming), threading.Thread(target=blocking)]
    for t in threads:
        t.start()
    deadline = time.time() + wait_s
    while server.metric("kvserve:num_requests_running") < 2 and time.time() < deadline:
        time.sleep(0.02)
    return threads, outcome
