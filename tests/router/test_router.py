"""The router with real `kvserve serve` instances: outputs equal one instance's, streaming passed through, bad
input passed through as the instance's 400, and an instance killed mid-stream: its request ends with an error
event, it leaves the rotation within seconds, the next requests go to the survivor, and nothing hangs."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.entrypoints.openai.server_utils import Server, all_healthy
from tests.router.procs import RouterProc

MODEL = "llama-gqa-untied"
ARGS = ("--dtype", "float32", "--max-model-len", "256")


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory(MODEL)


@pytest.fixture(scope="module")
def instances(model_path):
    servers = all_healthy(*(Server(model_path, *ARGS, wait=False) for _ in range(2)))
    yield servers
    for s in servers:
        s.stop()


def completion(url: str, model: str, prompt, max_tokens: int = 8, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_round_robin_matches_one_instance_and_alternates(instances, model_path):
    router = RouterProc([s.url for s in instances])
    try:
        prompts = [f"Request number {i} says hello" for i in range(4)]
        want = [completion(instances[0].url, model_path, p)["choices"][0]["text"] for p in prompts]
        got = [completion(router.url, model_path, p)["choices"][0]["text"] for p in prompts]
        assert got == want
        metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
        counts = [
            float(m.group(1))
            for s in instances
            if (
                m := re.search(
                    rf'kvserve_router_requests_total{{instance="{s.url[7:]}",reason="round_robin"}} (\S+)', metrics
                )
            )
        ]
        assert counts == [2.0, 2.0], metrics
        # Streaming: the instance's chunks, passed through.
        body = {"model": model_path, "prompt": prompts[0], "max_tokens": 8, "temperature": 0, "stream": True}
        text = ""
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == want[0]
        # The instance's own 400 comes back as it is; a body that is not JSON is the router's 400.
        bad_body = {"model": model_path, "prompt": "x", "max_tokens": -1}
        bad = httpx.post(f"{router.url}/v1/completions", json=bad_body)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
        bad = httpx.post(
            f"{router.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert bad.status_code == 400
        assert httpx.get(f"{router.url}/v1/models", timeout=5).json()["data"][0]["id"] == model_path
    finally:
        assert router.stop() == 0, router.log()


def test_a_dead_instance_leaves_the_rotation_and_its_stream_ends_with_an_error(model_path):
    a, b = all_healthy(Server(model_path, *ARGS, wait=False), Server(model_path, *ARGS, wait=False))
    router = RouterProc([a.url, b.url], "--policy", "least_loaded")
    try:
        # A long stream on one instance (least_loaded: the first request goes to either; find out which).
        body = {"model": model_path, "prompt": "Tell me", "max_tokens": 240, "temperature": 0, "stream": True}
        body["ignore_eos"] = True
        events, ended = [], None
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                events.append(line)
                if len(events) == 6:
                    busy = next(i for i in router.instances() if i["in_flight"] == 1)
                    victim = a if busy["url"] == a.url else b
                    victim.proc.kill()
                    killed_at = time.time()
            ended = time.time()
        assert any('"error"' in e for e in events[6:]), events[-3:]
        assert ended - killed_at < 10
        # Out of rotation within seconds; the survivor serves the next requests.
        deadline = time.time() + 10
        while time.time() < deadline and sum(i["healthy"] for i in router.instances()) != 1:
            time.sleep(0.2)
        assert [i["healthy"] for i in router.instances()] == [victim is b, victim is a]
        for _ in range(3):
            assert completion(router.url, model_path, "still there?")["choices"][0]["text"]
        assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    finally:
        router.stop()
        a.stop()
        b.stop()
