"""Engine death, SIGTERM and SIGKILL: no hang, clear errors, no orphan processes."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.openai.server_utils import Server, all_gone, start_two_long_requests

MODEL = "llama-gqa-untied"


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory(MODEL)


def start(model_path: str) -> Server:
    # A tight token budget keeps generation slow enough that requests are still in flight when we strike.
    return Server(model_path, "--dtype", "float32", "--max-model-len", "512", "--max-num-batched-tokens", "16")


def test_killing_the_engine_fails_health_and_pending_requests(model_path):
    server = start(model_path)
    try:
        engine_pid = server.engine_core_pid
        threads, outcome = start_two_long_requests(server, model_path)
        os.kill(engine_pid, signal.SIGKILL)  # both requests are mid-generation
        killed = time.time()
        for t in threads:
            t.join(10)
        assert isinstance(outcome["stream"], openai.APIError), outcome
        assert isinstance(outcome["plain"], openai.APIStatusError) and outcome["plain"].status_code == 503
        assert outcome["stream_t"] - killed < 5 and outcome["plain_t"] - killed < 5
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "EngineDeadError"
        with pytest.raises(openai.APIStatusError) as e:
            server.client(timeout=30).completions.create(model=model_path, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
    finally:
        assert server.stop() == 0, server.log()


def test_sigterm_with_requests_in_flight_exits_cleanly(model_path):
    server = start(model_path)
    engine_pids = server.engine_pids
    client = server.client(timeout=60)
    results: list[object] = []

    def run():
        try:
            r = client.completions.create(
                model=model_path, prompt="Story", max_tokens=300, temperature=0, extra_body={"ignore_eos": True}
            )
            results.append(r.choices[0].finish_reason)
        except Exception as e:  # an aborted request may see an error or a dropped connection
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    start_stop = time.time()
    assert server.stop(signal.SIGTERM) == 0, server.log()
    assert time.time() - start_stop < 30, "graceful shutdown must be bounded"
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a client hung after the server stopped"
    assert len(results) == 3
    assert all_gone(engine_pids), "engine core left behind"
    assert "Traceback" not in server.log()


def test_sigkill_of_server_takes_the_engine_down(model_path):
    server = start(model_path)
    engine_pids = server.engine_pids
    assert engine_pids
    server.stop(signal.SIGKILL)
    assert all_gone(engine_pids, timeout=10), "engine core orphaned after the server was SIGKILLed"
