"""The shared pool connector against the real stores, started by the tests: Mooncake (master + a storage node) and
Valkey holding the bytes. Two engines share one pool: blocks one computed are loaded by the other, token-identical
to recompute (fp32); the local prefix cache and the RAM tier come first (the multi-connector); a block evicted from
the pool, or a store killed mid-load, is a miss that is recomputed, never wrong output; nothing leaks."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cluster.mooncake import MooncakeMaster, MooncakeStorageNode
from kvserve.cluster.valkey import ValkeyService
from kvserve.kv_transfer.common import mooncake
from tests.conftest import assert_all_blocks_free

ENGINE = dict(dtype="float32", max_model_len=256, block_size=8, num_kv_blocks=64, max_num_batched_tokens=64)

needs_mooncake = pytest.mark.skipif(not mooncake.available(), reason="Mooncake is not installed")


def prompts(seed: int, n: int, prefix: list[int] | None = None, length: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, 40000) for _ in range(length)] for _ in range(n)]


def generate(llm: LLM, ps: list[list[int]], max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama-gqa-untied")


@pytest.fixture(scope="module")
def reference(model_path):
    llm = LLM(model_path, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture
def mooncake_pool():
    if not mooncake.available():
        pytest.skip("Mooncake is not installed")
    master = MooncakeMaster()
    node = MooncakeStorageNode(master.address, segment="64 MB")
    yield master, node
    node.stop()
    master.stop()


def pool_config(master: MooncakeMaster) -> dict:
    return {"kv_connector": "pool", "store": "mooncake", "master": master.address, "staging_bytes": "4MiB"}


def run_engine(model_path: str, config: dict, ps: list[list[int]], one_by_one: bool = False) -> tuple[list, dict]:
    llm = LLM(model_path, **ENGINE, kv_transfer_config=config)
    try:
        out = [generate(llm, [p])[0] for p in ps] if one_by_one else generate(llm, ps)
        stats = llm.stats()
        assert_all_blocks_free(llm)
        return out, stats["kv_transfer"]
    finally:
        llm.shutdown()


@needs_mooncake
def test_a_second_engine_loads_what_the_first_computed(model_path, reference, mooncake_pool):
    master, _ = mooncake_pool
    shared = prompts(1, 1, length=40)[0]
    ps = prompts(2, 3, prefix=shared, length=9)
    want = generate(reference, ps)
    # Engine A computes the shared prefix (and writes its blocks through to the pool).
    out, kv = run_engine(model_path, pool_config(master), [shared + [5, 6, 7]])
    assert kv["saved_blocks"] == 6 and kv["loaded_blocks"] == 0  # 52 computed tokens: 6 full blocks
    # Engine B, empty: the first request loads the 5 shared blocks from the pool, the rest hit them locally.
    out, kv = run_engine(model_path, pool_config(master), ps, one_by_one=True)
    assert out == want
    assert kv["loaded_blocks"] == 5 and kv["hit_blocks"] == 5 and kv["failed_loads"] == 0, kv


@needs_mooncake
def test_partial_prefix_hits_and_a_chain_with_the_ram_tier(model_path, reference, mooncake_pool):
    master, _ = mooncake_pool
    base = prompts(3, 1, length=24)[0]
    out, _ = run_engine(model_path, pool_config(master), [base + [9] * 8])  # blocks 0..3 of base + [9]*8 stored
    # A prompt sharing only the first 3 blocks (24 tokens), then its own: 3 blocks from the pool, the rest computed.
    partial = base + prompts(4, 1, length=20)[0]
    multi = {
        "kv_connector": "multi",
        "connectors": [{"kv_connector": "offload", "cpu_bytes": "4MiB"}, pool_config(master)],
    }
    out, kv = run_engine(model_path, multi, [partial])
    assert out == generate(reference, [partial])
    assert kv["pool.loaded_blocks"] == 3 and kv["offload.ram_hit_blocks"] == 0


@needs_mooncake
def test_a_store_killed_mid_workload_is_a_miss_not_an_error(model_path, reference, mooncake_pool):
    master, node = mooncake_pool
    shared = prompts(5, 1, length=40)[0]
    run_engine(model_path, pool_config(master), [shared + [1, 2]])
    ps = prompts(6, 3, prefix=shared, length=9)
    llm = LLM(model_path, **ENGINE, kv_transfer_config=pool_config(master))
    try:
        assert generate(llm, ps[:1]) == generate(reference, ps[:1])  # loaded from the pool
        llm.engine.engine_core.reset_prefix_cache()
        node.kill()  # the blocks' memory is gone; the master still lists them for a while
        master.kill()
        # Every request still ends, with the right output: the loads fail and the prompts are recomputed.
        assert generate(llm, ps) == generate(reference, ps)
        kv = llm.stats()["kv_transfer"]
        assert kv["failed_loads"] + kv["lookup_timeouts"] + kv["miss_blocks"] > 0, kv
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_valkey_holding_the_bytes(model_path, reference):
    server = ValkeyService(maxmemory="64mb")
    try:
        config = {"kv_connector": "pool", "store": "valkey", "url": server.url, "staging_bytes": "4MiB"}
        shared = prompts(7, 1, length=40)[0]
        run_engine(model_path, config, [shared + [3]])
        ps = prompts(8, 2, prefix=shared, length=9)
        out, kv = run_engine(model_path, config, ps, one_by_one=True)
        assert out == generate(reference, ps)
        assert kv["loaded_blocks"] == 5
        # A block whose bytes were corrupted in the store is a miss (checksum), recomputed.
        import redis

        client = redis.Redis.from_url(server.url)
        keys = client.keys("kvserve/*")
        for key in keys:
            value = bytearray(client.get(key))
            value[-1] ^= 0xFF
            client.set(key, bytes(value))
        out, kv = run_engine(model_path, config, ps, one_by_one=True)
        assert out == generate(reference, ps)
        assert kv["failed_loads"] >= 1
    finally:
        server.stop()
