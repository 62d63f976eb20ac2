"""The router's PD mode without processes: the two bodies it sends, which requests skip the prefill instance, and
which instances it keeps out of rotation (and says why)."""

from __future__ import annotations

import httpx

from kvserve.router.app import RouterConfig, RouterMetrics
from kvserve.router.pd import PDConfig, PDRouter, decode_body, prefill_body, several_prompts


def test_the_prefill_request_computes_the_prompt_only():
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 200,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 3,
        "stop": ["x"],
        "logprobs": 2,
        "temperature": 0.5,
        "seed": 3,
        "kv_transfer_params": {"mine": 1},
    }
    assert prefill_body(body) == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "stream": False,
        "temperature": 0.5,
        "seed": 3,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    chat = {"messages": [], "max_completion_tokens": 50, "response_format": {"type": "json_object"}}
    assert prefill_body(chat) == {
        "messages": [],
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    params = {"do_remote_prefill": True, "remote_request_id": "r"}
    assert decode_body(body, params) == {**body, "kv_transfer_params": params}


def test_a_batch_of_prompts_skips_disaggregation():
    assert several_prompts("/v1/completions", {"prompt": ["a", "b"]})
    assert several_prompts("/v1/completions", {"prompt": [[1, 2], [3]]})
    assert not several_prompts("/v1/completions", {"prompt": [1, 2, 3]})  # one prompt of token ids
    assert not several_prompts("/v1/completions", {"prompt": ["a"]})
    assert not several_prompts("/v1/chat/completions", {"messages": []})


def info(role: str, **kw) -> dict:
    return {
        "model": "m",
        "dtype": "bfloat16",
        "block_size": 16,
        "tensor_parallel_size": 1,
        "kv_connector": "pd",
        "kv_role": role,
        **kw,
    }


def test_instances_that_cannot_exchange_kv_are_kept_out_with_the_reason():
    config = RouterConfig([], pd=PDConfig(["http://p1", "http://p2"], ["http://d1", "http://d2", "http://d3"]))
    with httpx.Client() as client:  # never used: no request is sent
        router = PDRouter(config, client, RouterMetrics())
        p1, p2 = router.prefill.instances
        d1, d2, d3 = router.decode.instances
        p1.info, p2.info = info("kv_producer"), info("kv_consumer")
        d1.info, d2.info, d3.info = info("kv_consumer"), info("kv_both", block_size=32), {"kv_connector": None}
        for inst in (p1, p2, d1, d2, d3):
            inst.healthy = True
        assert router._usable(router.prefill, ("kv_producer", "kv_both"), "prefill") == [p1]
        assert router._usable(router.decode, ("kv_consumer", "kv_both"), "decode") == [d1]
        refused = {r["url"]: r["refused"] for r in router.describe()}
        assert refused["http://p1"] is None and refused["http://d1"] is None
        assert refused["http://p2"].startswith("not a prefill instance: kv_connector 'pd', kv_role 'kv_consumer'")
        assert refused["http://d2"] == "block_size 32 differs from the other instances' 16"
        assert refused["http://d3"].startswith("not a decode instance: kv_connector None")
