"""`kvserve cluster` as a new user runs it: one command starts the index, the pool, two instances and the router;
a request through the router is answered; SIGTERM stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from kvserve.cluster.process import free_port
from tests.entrypoints.openai.server_utils import child_pids, pid_alive


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        children = child_pids(todo.pop())
        out += children
        todo += children
    return out


def test_one_command_cluster(tiny_model_factory):
    model = tiny_model_factory("llama-gqa-untied")
    port = free_port()
    argv = [sys.executable, "-m", "kvserve.entrypoints.cli", "cluster", "--instances", "2", "--pool", "valkey"]
    argv += ["--model", model, "--port", str(port), "--serve-args", "--dtype", "float32", "--max-model-len", "256"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    try:
        lines = []
        deadline = time.time() + 300
        while time.time() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            if line.startswith("ready"):
                break
        assert any(line.startswith("router") for line in lines), "".join(lines)
        body = {"model": model, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        started = descendants(proc.pid)
        assert len(started) >= 5  # index, pool, 2 instances, router (and their engine processes)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    deadline = time.time() + 20
    while time.time() < deadline and any(pid_alive(p) for p in started):
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in started)
