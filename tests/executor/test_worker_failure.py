"""A tensor-parallel worker killed mid-request: the server reports the engine dead on /health (503) within 5 s,
every in-flight request ends with an error, and no process is left behind. A hung worker fails the engine after
worker_timeout_s."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.executor.base import WorkerFailedError
from tests.entrypoints.openai.server_utils import Server, all_gone, child_pids, start_two_long_requests


def worker_pids(server: Server) -> list[int]:
    pids = []
    for pid in child_pids(server.engine_core_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                pids.append(pid)
    return pids


def test_killing_a_worker_fails_health_and_in_flight_requests(tiny_model_factory):
    model = tiny_model_factory("llama-gqa-untied")
    server = Server(
        model,
        *("--dtype", "float32", "--max-model-len", "512", "--max-num-batched-tokens", "16"),
        *("--tensor-parallel-size", "2"),
    )
    try:
        workers = worker_pids(server)
        assert len(workers) == 2, workers
        engine_pids = server.engine_pids + workers
        threads, outcome = start_two_long_requests(server, model, wait_s=20)
        os.kill(workers[1], signal.SIGKILL)  # rank 1; both requests are mid-generation
        killed = time.time()
        health = None
        while time.time() - killed < 5:
            health = httpx.get(f"{server.url}/health", timeout=5)
            if health.status_code == 503:
                break
            time.sleep(0.05)
        assert health is not None and health.status_code == 503, "health did not turn 503 within 5 s"
        assert health.json()["error"]["type"] == "EngineDeadError"
        for t in threads:
            t.join(10)
        assert isinstance(outcome["stream"], openai.APIError), outcome
        assert isinstance(outcome["plain"], openai.APIStatusError) and outcome["plain"].status_code == 503
        assert outcome["stream_t"] - killed < 5 and outcome["plain_t"] - killed < 5
        assert "worker 1" in server.log()  # the engine core says which worker failed
    finally:
        assert server.stop() == 0, server.log()
    assert all_gone(engine_pids), "an engine or worker process outlived the server"


def test_a_hung_worker_fails_the_step_after_the_timeout(tiny_model_factory):
    """A worker that stops answering (SIGSTOP: alive, never done) fails generate() with WorkerFailedError once
    worker_timeout_s has passed, and shutdown still ends both workers."""
    model = tiny_model_factory("llama-gqa-untied")
    llm = LLM(model, dtype="float32", max_model_len=128, tensor_parallel_size=2, worker_timeout_s=2.0)
    executor = llm.engine.engine_core.executor
    procs = list(executor.procs)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        os.kill(procs[1].pid, signal.SIGSTOP)
        with pytest.raises(WorkerFailedError, match=r"did not (answer|reach)"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert executor.failure is not None
        with pytest.raises(WorkerFailedError):  # the executor stays failed
            executor.check_health()
    finally:
        llm.shutdown()
    for proc in procs:
        proc.join(5)
        assert not proc.is_alive(), f"worker pid {proc.pid} outlived shutdown"
