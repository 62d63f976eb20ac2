"""cache_aware routing with real processes: two `kvserve serve` instances publishing KV events, the router's indexer
writing them into a real Valkey server, and the router sending each prompt where its prefix is cached. The index
killed mid-run: requests keep succeeding, routed by load."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from kvserve.cluster.process import free_port
from kvserve.cluster.valkey import ValkeyService
from tests.entrypoints.openai.server_utils import Server, all_healthy
from tests.router.procs import RouterProc

ARGS = ("--dtype", "float32", "--max-model-len", "512", "--block-size", "16")


def events_args() -> tuple[str, str]:
    config = f'{{"endpoint": "tcp://127.0.0.1:{free_port()}", "replay_endpoint": "tcp://127.0.0.1:{free_port()}"}}'
    return "--kv-events-config", config


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40000) for _ in range(n)]


def complete(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def hits(server: Server) -> float:
    return server.metric("kvserve:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama-gqa-untied")


def test_requests_follow_their_cached_prefix_and_survive_the_index_dying(model_path):
    index = ValkeyService()
    a, b = all_healthy(
        Server(model_path, *ARGS, *events_args(), wait=False), Server(model_path, *ARGS, *events_args(), wait=False)
    )
    router = None
    try:
        p1, p2 = tokens(1, 200), tokens(2, 200)
        # p2's blocks land on b before the router exists: its indexer learns of them on watch, from b's replay socket.
        want2 = complete(b.url, model_path, p2 + [5])
        router = RouterProc([a.url, b.url], "--policy", "cache_aware", "--model", model_path, "--index-url", index.url)
        deadline = time.time() + 30
        while time.time() < deadline and len(httpx.get(f"{router.url}/router/indexer").json()["instances"]) < 2:
            time.sleep(0.1)
        # p1's through the router (the idle tie goes to a).
        want1 = complete(router.url, model_path, p1 + [5])
        deadline = time.time() + 10
        while time.time() < deadline and httpx.get(f"{router.url}/router/indexer").json()["batches"] < 2:
            time.sleep(0.1)
        time.sleep(0.5)
        hits_a, hits_b = hits(a), hits(b)
        # Each follow-up goes where its prefix is: 192 cached prompt tokens (12 blocks) are hits there.
        assert complete(router.url, model_path, p2 + [5]) == want2
        assert complete(router.url, model_path, p1 + [5]) == want1
        deadline = time.time() + 5  # the frontends' counters follow their engines' step reports
        while time.time() < deadline and (hits(b) - hits_b, hits(a) - hits_a) != (192, 192):
            time.sleep(0.1)
        assert hits(b) - hits_b == 192 and hits(a) - hits_a == 192
        metrics = httpx.get(f"{router.url}/metrics").text
        assert 'reason="cache"' in metrics
        # The index dies: routing falls back to load, no request fails.
        index.kill()
        for i in range(4):
            assert complete(router.url, model_path, tokens(10 + i, 40))
        assert 'reason="no_index"' in httpx.get(f"{router.url}/metrics").text
    finally:
        if router is not None:
            router.stop()
        a.stop()
        b.stop()
        index.stop()


def test_round_robin_over_a_shared_pool_matches_one_instance(model_path):
    """Through the router, each prompt computed once: the other instance loads it from the pool (Mooncake), a
    prompt sharing part of the prefix loads that part, and repeats hit the instance's own cache; outputs equal a
    single instance's (fp32)."""
    from kvserve.cluster.mooncake import MooncakeMaster, MooncakeStorageNode
    from kvserve.kv_transfer.common import mooncake

    if not mooncake.available():
        pytest.skip("Mooncake is not installed")
    master = MooncakeMaster()
    node = MooncakeStorageNode(master.address, segment="64 MB")
    pool = f'{{"kv_connector": "pool", "store": "mooncake", "master": "{master.address}", "staging_bytes": "8MiB"}}'
    a, b, single = all_healthy(
        Server(model_path, *ARGS, "--kv-transfer-config", pool, wait=False),
        Server(model_path, *ARGS, "--kv-transfer-config", pool, wait=False),
        Server(model_path, *ARGS, wait=False),
    )
    router = RouterProc([a.url, b.url], "--policy", "round_robin")
    try:
        base = tokens(20, 128)
        prompts = [base + [11], base + [11], base + [11], base[:64] + tokens(21, 50)]
        want = [complete(single.url, model_path, p) for p in prompts]
        got = []
        for p in prompts:
            got.append(complete(router.url, model_path, p))
            time.sleep(0.5)  # the write-through saves of one request land before the next looks
        assert got == want
        loaded = [s.metric("kvserve:kv_transfer", stat="loaded_blocks") for s in (a, b)]
        local = [hits(s) for s in (a, b)]
        # a computed base (turn 1); b loaded its 8 blocks (turn 2); a hit its own cache (turn 3); b's partial
        # prompt hit the 4 shared blocks it had loaded (turn 4).
        assert loaded == [0.0, 8.0] and local == [128.0, 64.0], (loaded, local)
    finally:
        router.stop()
        for s in (a, b, single):
            s.stop()
        node.stop()
        master.stop()
