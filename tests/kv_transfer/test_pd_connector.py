"""The pd connector between two in-process engines (a producer stepped on a thread, a consumer driven by the test):
greedy outputs equal a single engine's, token for token (fp32), over both transports; the consumer's own prefix
hits shorten the transfer; n > 1 shares one fetch; leases end (pulled, released, expired) and free every block;
a failed transfer is recomputed, or ends the request with an error when the fallback is off or the engines'
KV caches differ."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kv_transfer.common import mooncake
from tests.conftest import assert_all_blocks_free
from tests.kv_transfer.pd_helpers import Producer, pd_config, remote

ENGINE = dict(dtype="float32", max_model_len=256, block_size=8, num_kv_blocks=64, max_num_batched_tokens=64)


def prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, 40000) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **{"temperature": 0, "ignore_eos": True, **kw})


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def run(llm: LLM, ps: list[list[int]], params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama-gqa-untied")


@pytest.fixture(scope="module")
def reference(model_path):
    llm = LLM(model_path, **ENGINE)
    yield llm
    llm.shutdown()


def pair(model_path, producer: dict | None = None, consumer: dict | None = None, **engine):
    p = Producer(
        LLM(model_path, **{**ENGINE, **engine}, kv_transfer_config=pd_config("kv_producer", **(producer or {})))
    )
    d = LLM(model_path, **{**ENGINE, **engine}, kv_transfer_config=pd_config("kv_consumer", **(consumer or {})))
    return p, d


@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
def test_remote_prefill_is_token_identical(model_path, reference, transport):
    if transport == "mooncake" and not mooncake.available():
        pytest.skip("Mooncake is not installed")
    # Shorter than a block, exactly three blocks, and odd lengths.
    ps = prompts(1, [5, 24, 30, 61])
    p, d = pair(model_path, {"transport": transport}, {"transport": transport})
    try:
        params = [p.prefill(x) for x in ps]
        assert [len(x["remote_block_ids"]) for x in params] == [0, 3, 3, 7]
        assert params[1]["remote_ranks"] == [[params[1]["remote_host"], params[1]["remote_port"]]]
        outs = [run(d, [x], remote(par))[0] for x, par in zip(ps, params, strict=True)]
        assert tokens(outs) == tokens(run(reference, ps, greedy()))
        stats = d.stats()["kv_transfer"]
        # The consumer loads whole blocks and computes at least one token: 0, 2 (of 3), 3 and 7 blocks.
        assert stats["remote_prefills"] == 3 and stats["remote_prefill_blocks"] == 12
        assert stats["remote_prefill_failures"] == 0
        p.wait_idle()
        assert p.stats()["kv_transfer"]["remote_decodes"] == 3
        assert_all_blocks_free(d)
        assert_all_blocks_free(p.llm)
    finally:
        p.close()
        d.shutdown()


def test_the_consumers_own_prefix_hits_shorten_the_transfer(model_path, reference):
    shared = prompts(2, [32])[0]
    ps = prompts(3, [21, 13], prefix=shared)
    p, d = pair(model_path)
    try:
        run(d, [shared + [5, 6, 7]], greedy(2))  # the consumer computed the 4 shared blocks itself
        params = [p.prefill(x) for x in ps]
        outs = [run(d, [x], remote(par))[0] for x, par in zip(ps, params, strict=True)]
        assert tokens(outs) == tokens(run(reference, ps, greedy()))
        # 53 and 45 tokens: 6 and 5 whole blocks loadable, 4 of each already here.
        assert d.stats()["kv_transfer"]["remote_prefill_blocks"] == 2 + 1
        assert d.stats()["prefix_cache"]["num_hit_tokens"] == 2 * 32
        p.wait_idle()
        assert_all_blocks_free(d)
        assert_all_blocks_free(p.llm)
    finally:
        p.close()
        d.shutdown()


def test_samples_of_one_request_share_one_fetch(model_path, reference):
    (x,) = prompts(4, [45])
    p, d = pair(model_path)
    try:
        params = p.prefill(x)
        (out,) = run(d, [x], remote(params, n=3, seed=7, temperature=0.8))
        (want,) = run(reference, [x], greedy(n=3, seed=7, temperature=0.8))
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
        stats = d.stats()["kv_transfer"]
        assert stats["remote_prefills"] == 1 and stats["remote_prefill_blocks"] == 5
        # The other two samples hit the fetched blocks in the prefix cache.
        assert d.stats()["prefix_cache"]["num_hit_tokens"] == 2 * 40
        p.wait_idle()
        assert_all_blocks_free(d)
        assert_all_blocks_free(p.llm)
    finally:
        p.close()
        d.shutdown()


def test_nothing_to_fetch_releases_the_lease_at_once(model_path, reference):
    (x,) = prompts(5, [40])
    p, d = pair(model_path, {"lease_s": 600})
    try:
        run(d, [x], greedy(1))  # the consumer has the whole prompt already
        params = p.prefill(x)
        (out,) = run(d, [x], remote(params))
        assert tokens([out]) == tokens(run(reference, [x], greedy()))
        assert d.stats()["kv_transfer"]["remote_prefills"] == 0
        p.wait_idle(timeout=10)  # released, not expired (the lease is 10 minutes)
        assert p.stats()["kv_transfer"]["leases_expired"] == 0
        assert_all_blocks_free(p.llm)
    finally:
        p.close()
        d.shutdown()


@pytest.mark.parametrize("recompute", [True, False])
def test_an_expired_lease_is_recomputed_or_ends_the_request(model_path, reference, recompute):
    (x,) = prompts(6, [37])
    p, d = pair(model_path, {"lease_s": 0.3}, {"recompute_on_failure": recompute})
    try:
        params = p.prefill(x)
        p.wait_idle()  # expired: the producer freed the blocks by itself
        assert p.stats()["kv_transfer"]["leases_expired"] == 1
        assert_all_blocks_free(p.llm)
        (out,) = run(d, [x], remote(params))
        if recompute:
            assert tokens([out]) == tokens(run(reference, [x], greedy()))
        else:
            assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "abort"
            assert "lease of 0.3 s expired" in out.kv_transfer_params["error"]
        assert d.stats()["kv_transfer"]["remote_prefill_failures"] == 1
        assert_all_blocks_free(d)
    finally:
        p.close()
        d.shutdown()


def test_a_producer_gone_before_the_pull_is_recomputed(model_path, reference):
    (x,) = prompts(7, [50])
    p, d = pair(model_path)
    try:
        params = p.prefill(x)
    finally:
        p.close()  # its side channel is gone: connection refused
    try:
        (out,) = run(d, [x], remote(params))
        assert tokens([out]) == tokens(run(reference, [x], greedy()))
        assert d.stats()["kv_transfer"]["remote_prefill_failures"] == 1
        assert_all_blocks_free(d)
    finally:
        d.shutdown()


def test_incompatible_engines_refuse_the_transfer_with_a_clear_error(model_path):
    (x,) = prompts(8, [40])
    p = Producer(LLM(model_path, **ENGINE, kv_transfer_config=pd_config("kv_producer")))
    d = LLM(model_path, **{**ENGINE, "dtype": "bfloat16"}, kv_transfer_config=pd_config("kv_consumer"))
    try:
        params = p.prefill(x)
        (out,) = run(d, [x], remote(params))
        # Never recomputed: the deployment is wrong, and the user must hear of it.
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "abort"
        error = out.kv_transfer_params["error"]
        assert error.startswith(f"remote prefill refused from engine {params['remote_engine_id']}: KV dtype differs")
        assert "float32" in error and "bfloat16" in error
        p.wait_idle(timeout=10)  # the refused reader's lease is released
        assert_all_blocks_free(p.llm)
        assert_all_blocks_free(d)
    finally:
        p.close()
        d.shutdown()


def test_tensor_parallel_ranks_each_move_their_slice(model_path, reference):
    ps = prompts(9, [29, 44])
    tp = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
    p, d = pair(model_path, **tp)
    try:
        params = [p.prefill(x) for x in ps]
        assert params[0]["remote_tp_size"] == 2 and len({tuple(r) for r in params[0]["remote_ranks"]}) == 2
        outs = [run(d, [x], remote(par))[0] for x, par in zip(ps, params, strict=True)]
        assert tokens(outs) == tokens(run(reference, ps, greedy()))
        stats = d.stats()["kv_transfer"]
        assert stats["remote_prefill_blocks"] == 3 + 5 and stats["remote_prefill_failures"] == 0
        p.wait_idle()
        assert_all_blocks_free(d)
        assert_all_blocks_free(p.llm)
    finally:
        p.close()
        d.shutdown()
