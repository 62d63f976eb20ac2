"""The wider connector API with a stand-in connector (tests/kv_transfer/standin.py): kv_transfer_params in and out
(offline and through the OpenAI server), "ask again", KV events in order, delayed saves that keep a finished
request's blocks, handshake metadata, and the multi-connector's fallthrough (local tier first, then the pool)."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.conftest import assert_all_blocks_free
from tests.entrypoints.openai.server_utils import Server

ENGINE = dict(dtype="float32", max_model_len=256, block_size=8, num_kv_blocks=48, max_num_batched_tokens=64)
MODULE = "tests.kv_transfer.standin"


def standin(store_dir) -> dict:
    return {"kv_connector": "standin", "kv_connector_module_path": MODULE, "store_dir": str(store_dir)}


def prompts(seed: int, n: int, prefix: list[int] | None = None, length: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, 40000) for _ in range(length)] for _ in range(n)]


def greedy(max_tokens: int = 12, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def generate(llm: LLM, ps: list[list[int]], params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama-gqa-untied")


@pytest.fixture(scope="module")
def reference(model_path):
    llm = LLM(model_path, **ENGINE)
    yield llm
    llm.shutdown()


def test_params_round_trip_and_delayed_saves_keep_blocks(model_path, reference, tmp_path):
    ps = prompts(1, 3)
    llm = LLM(model_path, **ENGINE, kv_transfer_config=standin(tmp_path))
    try:
        params = [greedy(extra_args={"kv_transfer_params": {"tag": i}}) for i in range(3)]
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        for i, o in enumerate(outs):
            # 30 prompt + 12 output tokens, 41 computed: 5 full blocks of 8 saved.
            assert o.kv_transfer_params == {"echo": {"tag": i}, "saved_blocks": 5}
        assert [o.outputs[0].token_ids for o in outs] == generate(reference, ps, greedy())
        core = llm.engine.engine_core
        # generate() returned only once every save was reported: the kept blocks are free again.
        assert not core.scheduler._saving and not core.has_unfinished_requests()
        assert_all_blocks_free(llm)
        connector = core.scheduler.connector
        assert connector.handshake == [{"rank": 0, "pid": connector.handshake[0]["pid"]}]
    finally:
        llm.shutdown()


def test_loads_from_the_store_are_token_identical(model_path, reference, tmp_path):
    shared = prompts(2, 1, length=40)[0]
    ps = prompts(3, 3, prefix=shared, length=9)
    want = generate(reference, ps, greedy())
    first = LLM(model_path, **ENGINE, kv_transfer_config=standin(tmp_path))
    try:
        generate(first, [shared + [7, 8, 9]], greedy(4))
    finally:
        first.shutdown()
    # A new engine: an empty prefix cache, the store on disk. One request after another: the first loads the
    # shared 40 tokens, and the loaded blocks join the prefix cache, where the others find them.
    llm = LLM(model_path, **ENGINE, kv_transfer_config=standin(tmp_path))
    try:
        assert [generate(llm, [p], greedy())[0] for p in ps] == want
        stats = llm.stats()["kv_transfer"]
        assert stats["loaded_blocks"] == 5
        assert llm.stats()["prefix_cache"]["num_hit_tokens"] == 2 * 40
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_ask_again_keeps_the_request_in_place_while_others_run(model_path, reference, tmp_path):
    ps = prompts(4, 3)
    llm = LLM(model_path, **ENGINE, kv_transfer_config=standin(tmp_path))
    try:
        engine = llm.engine
        engine.add_request(
            "slow", {"prompt_token_ids": ps[0]}, greedy(extra_args={"kv_transfer_params": {"ask_again": 3}})
        )
        engine.add_request("fast", {"prompt_token_ids": ps[1]}, greedy())
        first_tokens: dict[str, int] = {}
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            engine.step()
            for req_id, request in engine.engine_core.scheduler.requests.items():
                if request.num_output_tokens and req_id not in first_tokens:
                    first_tokens[req_id] = step
        # "fast" ran from the first step; "slow" was asked about three more times before it was admitted.
        assert first_tokens["fast"] == 1 and first_tokens["slow"] == 4
        assert llm.stats()["kv_transfer"]["ask_again"] == 3
        assert generate(llm, ps[:1], greedy()) == generate(reference, ps[:1], greedy())
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_kv_events_in_order(model_path, tmp_path):
    """The pool's events (stored as blocks are scheduled, removed on eviction, cleared on reset) and the
    connector's (stored once its save completes), drained by the engine core after each step."""
    llm = LLM(
        model_path,
        **{**ENGINE, "num_kv_blocks": 8},
        kv_transfer_config=standin(tmp_path),
        kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},
    )
    core = llm.engine.engine_core
    try:
        a, b = prompts(5, 2, length=33)
        generate(llm, [a], greedy(2))  # 33 + 2 tokens: blocks 0..3 of a cached
        batches = []
        while (batch := core.take_kv_events()) is not None:
            batches.append(batch)
        events = [e for batch in batches for e in batch.events]
        hashes_a = list(core.scheduler.kv.pool.cached)
        stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "device"]
        assert [h for e in stored for h in e.block_hashes] == hashes_a
        assert stored[0].parent_block_hash is None and stored[0].token_ids[:8] == a[:8]
        standin_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "standin"]
        assert len(standin_stored) == 1 and standin_stored[0].block_hashes == hashes_a
        # The connector's event comes after the pool's (the save completes after the request ends).
        assert events.index(standin_stored[0]) > events.index(stored[-1])
        # b needs 5 blocks of 8: evicting a's cached blocks, tail first.
        generate(llm, [b], greedy(2))
        events = [e for batch in iter(core.take_kv_events, None) for e in batch.events]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert removed and set(removed) <= set(hashes_a)
        assert core.reset_prefix_cache()
        events = core.take_kv_events().events
        assert isinstance(events[-1], AllBlocksCleared)
    finally:
        llm.shutdown()


def test_multi_connector_falls_through_to_the_pool(model_path, reference, tmp_path):
    shared = prompts(6, 1, length=40)[0]
    ps = prompts(7, 2, prefix=shared, length=9)
    want = generate(reference, ps, greedy())
    multi = {
        "kv_connector": "multi",
        "connectors": [{"kv_connector": "offload", "cpu_bytes": "4MiB"}, standin(tmp_path)],
    }
    first = LLM(model_path, **ENGINE, kv_transfer_config=multi)
    try:
        generate(first, [shared + [5, 6]], greedy(2))
        first.engine.engine_core.reset_prefix_cache()
        # Both tiers hold the shared blocks now: the earlier connector (the RAM tier) loads them.
        assert generate(first, ps[:1], greedy()) == want[:1]
        stats = first.stats()["kv_transfer"]
        assert stats["offload.ram_hit_blocks"] == 5 and stats["standin.loaded_blocks"] == 0
    finally:
        first.shutdown()
    # A new engine: its RAM tier is empty, the stand-in's store is not: the chain falls through to it.
    llm = LLM(model_path, **ENGINE, kv_transfer_config=multi)
    try:
        assert generate(llm, ps[1:], greedy()) == want[1:]
        stats = llm.stats()["kv_transfer"]
        assert stats["offload.ram_hit_blocks"] == 0 and stats["standin.loaded_blocks"] == 5
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_kv_transfer_params_through_the_openai_server(model_path, tmp_path):
    config = json.dumps(standin(tmp_path))
    srv = Server(model_path, "--dtype", "float32", "--max-model-len", "256", "--kv-transfer-config", config)
    try:
        body = {"model": model_path, "prompt": "Hello there, how are you today?", "max_tokens": 3, "temperature": 0}
        sent = {"do_remote_decode": True, "remote_engine_id": "x"}
        got = httpx.post(f"{srv.url}/v1/completions", json={**body, "kv_transfer_params": sent}, timeout=60).json()
        assert got["kv_transfer_params"]["echo"] == sent
        chat = {"model": model_path, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        got = httpx.post(f"{srv.url}/v1/chat/completions", json={**chat, "kv_transfer_params": {"k": 1}}, timeout=60)
        assert got.json()["kv_transfer_params"]["echo"] == {"k": 1}
        bad = httpx.post(f"{srv.url}/v1/completions", json={**body, "kv_transfer_params": [1]}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    finally:
        assert srv.stop() == 0, srv.log()
