"""The router's PD mode with real processes: a prefill instance and a decode instance (`kvserve serve` with the pd
connector) behind `kvserve router --prefill ... --decode ...`. Greedy outputs equal a single instance's (fp32):
streaming and not, n > 1, stop strings, chat, prompts that hit the prefill instance's prefix cache; the KV
really moves (the decode instance's counters), and afterwards neither instance holds a block. Once more with the
two instances in separate network namespaces, so the KV crosses a veth pair."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.openai.server_utils import Server, all_healthy
from tests.netns import veth_pair
from tests.router.pd_procs import (
    NetnsProc,
    metric,
    pd_router,
    pd_server,
    pd_transfer_config,
    transfer_stat,
    wait_kv_free,
)

MODEL = "llama-gqa-untied"
ARGS = ("--dtype", "float32", "--max-model-len", "512")
SHARED = " ".join(f"shared context sentence {i} about the topic at hand." for i in range(12))


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory(MODEL)


@pytest.fixture(scope="module")
def cluster(model_path):
    reference, prefill, decode = all_healthy(
        Server(model_path, *ARGS, wait=False),
        pd_server(model_path, "kv_producer", *ARGS, wait=False),
        pd_server(model_path, "kv_consumer", *ARGS, wait=False),
    )
    router = pd_router([prefill.url], [decode.url])
    yield reference, prefill, decode, router
    router.stop()
    for s in (decode, prefill, reference):
        s.stop()


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def complete(url: str, model: str, prompt, **kw) -> dict:
    return post(url, "/v1/completions", {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": 16, **kw})


def choices(resp: dict) -> list[tuple[str, str]]:
    return [(c["text"], c["finish_reason"]) for c in sorted(resp["choices"], key=lambda c: c["index"])]


def streamed(url: str, body: dict) -> tuple[str, list[str]]:
    text, reasons = "", []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            assert "error" not in msg, msg
            for c in msg["choices"]:
                text += c["text"]
                if c.get("finish_reason"):
                    reasons.append(c["finish_reason"])
    return text, reasons


def test_outputs_through_prefill_and_decode_equal_one_instance(cluster, model_path):
    reference, prefill, decode, router = cluster
    prompts = [
        SHARED + " First question: what follows?",
        SHARED + " Second question, sharing the prefix: and then?",  # hits the prefill instance's prefix cache
        "A short prompt",  # under one block: nothing to move, the decode instance computes it
        " ".join(f"word{i}" for i in range(90)),
    ]
    for p in prompts:
        assert choices(complete(router.url, model_path, p)) == choices(complete(reference.url, model_path, p))
    # Streaming, with the client's stream options passed to the decode instance.
    body = {"model": model_path, "prompt": prompts[3], "max_tokens": 20, "temperature": 0}
    got = streamed(router.url, {**body, "stream_options": {"include_usage": True}})
    assert got == streamed(reference.url, body)
    # n > 1 (seeded sampling: sample i draws with seed + i on either path).
    sampled = {"n": 3, "temperature": 0.9, "seed": 11, "max_tokens": 12}
    assert choices(complete(router.url, model_path, prompts[0], **sampled)) == choices(
        complete(reference.url, model_path, prompts[0], **sampled)
    )
    # A stop string taken from the middle of the output: cut at the same place.
    text = complete(reference.url, model_path, prompts[3], max_tokens=24)["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = choices(complete(reference.url, model_path, prompts[3], max_tokens=24, stop=[stop]))
    assert want[0][1] == "stop"
    assert choices(complete(router.url, model_path, prompts[3], max_tokens=24, stop=[stop])) == want
    # Chat.
    chat = {"model": model_path, "messages": [{"role": "user", "content": SHARED}], "max_tokens": 12, "temperature": 0}
    want_chat = post(reference.url, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    assert post(router.url, "/v1/chat/completions", chat)["choices"][0]["message"]["content"] == want_chat

    d, p = decode.metrics(), prefill.metrics()
    # Every prompt of a block or more was prefilled remotely and kept for the decode instance (7 requests); the
    # decode instance fetched what its own prefix cache lacked (the repeated prompts it had already).
    assert transfer_stat(p, "remote_decodes") == 7
    assert transfer_stat(d, "remote_prefills") >= 3 and transfer_stat(d, "remote_prefill_failures") == 0
    assert transfer_stat(d, "bytes_received") > 0
    assert metric(p, "kvserve:prefix_cache_hits_total") > 0
    wait_kv_free(prefill.metrics)
    wait_kv_free(decode.metrics)


def test_the_kv_crosses_a_veth_between_namespaces(model_path):
    """The prefill instance in namespace A, the decode instance and the router in B: the KV crosses the veth."""
    with veth_pair("pd") as (a, b):
        prefill = NetnsProc(
            a,
            ["serve", "--model", model_path, *ARGS, "--kv-transfer-config", pd_transfer_config("kv_producer", a.ip)],
            "prefill",
            wait=False,
        )
        decode = NetnsProc(
            b,
            ["serve", "--model", model_path, *ARGS, "--kv-transfer-config", pd_transfer_config("kv_consumer", b.ip)],
            "decode",
            wait=False,
        )
        prefill, decode = all_healthy(prefill, decode)
        router = NetnsProc(
            b, ["router", "--prefill", prefill.url, "--decode", decode.url, "--health-interval", "0.5"], "router"
        )
        try:
            prompt = " ".join(f"token{i}" for i in range(90))
            body = {"model": model_path, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            # The reference: the prefill instance alone, before it has seen the prompt.
            want = prefill.post("/v1/completions", body).json()["choices"][0]["text"]
            received = b.bytes_received()
            got = router.post("/v1/completions", body)
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == want
            d = decode.text("/metrics")
            moved = transfer_stat(d, "bytes_received")
            assert moved > 0 and transfer_stat(d, "remote_prefill_failures") == 0
            assert b.bytes_received() - received >= moved  # it came over the veth
            wait_kv_free(lambda: prefill.text("/metrics"))
            wait_kv_free(lambda: decode.text("/metrics"))
        finally:
            for proc in (router, decode, prefill):
                proc.stop()
