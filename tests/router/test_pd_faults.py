"""Faults in the router's PD mode, with real processes: a client going away (while its KV is in flight, and
mid-stream), the prefill instance killed mid-transfer (across network namespaces), the decode instance killed
mid-transfer, a decode instance refusing a request it cannot hold, and a lease expiring before its reader comes.
Each request ends with output or a clear error within a bounded time; afterwards every surviving instance reports
KV usage 0 and the router serves the next request.

A producer option stalls each push halfway (`debug_push_stall_s`), so that a transfer is reliably in flight when
the test strikes; the consumer waits for it (its `timeout_s` is longer)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.server_utils import all_healthy, child_pids
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
PROMPT = " ".join(f"item{i}" for i in range(60))  # ~180 tokens: 11 blocks to move
STALL_S = 2.0


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory(MODEL)


def body(model: str, prompt: str = PROMPT, **kw) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, **kw}


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def wait_until(check, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        start = time.time()
        try:
            out["value"] = fn()
        except Exception as e:  # inspected by the test
            out["error"] = e
        out["seconds"] = time.time() - start

    t = threading.Thread(target=run)
    t.start()
    return t, out


def kill_server(proc_pid: int) -> None:
    """SIGKILL a `kvserve serve` and its engine core (where the side channel lives) at once."""
    for pid in [*child_pids(proc_pid), proc_pid]:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(model_path):
    # Leases of 1.5 s (the expiry test), every push stalled halfway; the decode instance waits up to 30 s for
    # a stalled push, and has 24 blocks (384 tokens): a longer request cannot fit there.
    prefill, decode = all_healthy(
        pd_server(model_path, "kv_producer", *ARGS, lease_s=1.5, debug_push_stall_s=STALL_S, wait=False),
        pd_server(model_path, "kv_consumer", *ARGS, "--num-kv-blocks", "24", timeout_s=30, wait=False),
    )
    router = pd_router([prefill.url], [decode.url])
    yield prefill, decode, router
    router.stop()
    decode.stop()
    prefill.stop()


def usage(server) -> float:
    return metric(server.metrics(), "kvserve:kv_cache_usage_perc")


def test_client_gone_while_its_kv_is_in_flight_or_mid_stream(cluster, model_path):
    prefill, decode, router = cluster
    want = text_of(httpx.post(f"{prefill.url}/v1/completions", json=body(model_path), timeout=60))
    # 1. Gone while the decode instance waits for the (stalled) push: it aborts the request, whose blocks are freed
    #    once the push lands; the prefill instance's lease ends with the push.
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body(model_path, stream=True), timeout=60) as r:
        assert r.status_code == 200
        wait_until(lambda: usage(decode) > 0, what="the decode instance to allocate the blocks")
    gone = time.time()
    wait_kv_free(decode.metrics, timeout=STALL_S + 10)
    wait_kv_free(prefill.metrics, timeout=STALL_S + 10)
    assert time.time() - gone < STALL_S + 10
    assert metric(decode.metrics(), "kvserve:request_success_total", finished_reason="abort") == 1
    # 2. Gone mid-stream.
    long = body(model_path, stream=True, max_tokens=300, ignore_eos=True, prompt="Tell me")  # fits 384 tokens
    with httpx.stream("POST", f"{router.url}/v1/completions", json=long, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 4:
                break
    wait_kv_free(decode.metrics)
    assert metric(decode.metrics(), "kvserve:request_success_total", finished_reason="abort") == 2
    # The router serves the next request, and its answer is a single instance's.
    assert text_of(httpx.post(f"{router.url}/v1/completions", json=body(model_path), timeout=60)) == want
    wait_kv_free(prefill.metrics)
    wait_kv_free(decode.metrics)


def test_a_decode_instance_that_cannot_hold_the_request_hands_it_back(cluster, model_path):
    prefill, decode, router = cluster
    big = body(model_path, prompt=" ".join(f"item{i}" for i in range(130)), max_tokens=24)  # > 384 tokens
    want = text_of(httpx.post(f"{prefill.url}/v1/completions", json=big, timeout=60))
    assert httpx.post(f"{decode.url}/v1/completions", json=big, timeout=60).status_code == 400
    before = transfer_stat(prefill.metrics(), "remote_decodes")
    # The decode instance refuses it (400): the prefill instance runs the whole request (its prompt is cached there).
    assert text_of(httpx.post(f"{router.url}/v1/completions", json=big, timeout=60)) == want
    assert transfer_stat(prefill.metrics(), "remote_decodes") == before + 1
    # The lease nobody reads expires (1.5 s): every block free on both sides.
    wait_kv_free(prefill.metrics, timeout=10)
    wait_kv_free(decode.metrics)
    assert text_of(httpx.post(f"{router.url}/v1/completions", json=body(model_path), timeout=60))


def test_an_expired_lease_is_recomputed_by_the_decode_instance(cluster, model_path):
    prefill, decode, router = cluster
    prompt = " ".join(f"other{i}" for i in range(60))
    want = text_of(httpx.post(f"{prefill.url}/v1/completions", json=body(model_path, prompt), timeout=60))
    # The router's first call by hand, then nobody comes for 1.5 s.
    first = httpx.post(
        f"{prefill.url}/v1/completions",
        json={**body(model_path, prompt), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=60,
    ).json()["kv_transfer_params"]
    expired = transfer_stat(prefill.metrics(), "leases_expired")
    wait_kv_free(prefill.metrics, timeout=10)
    failures = transfer_stat(decode.metrics(), "remote_prefill_failures")
    r = httpx.post(f"{decode.url}/v1/completions", json={**body(model_path, prompt), "kv_transfer_params": first})
    assert text_of(r) == want
    assert transfer_stat(decode.metrics(), "remote_prefill_failures") == failures + 1
    assert transfer_stat(prefill.metrics(), "leases_expired") >= expired
    wait_kv_free(decode.metrics)
    assert text_of(httpx.post(f"{router.url}/v1/completions", json=body(model_path), timeout=60))


def test_the_decode_instance_killed_mid_transfer(model_path):
    prefill, decode = all_healthy(
        pd_server(model_path, "kv_producer", *ARGS, debug_push_stall_s=STALL_S, wait=False),
        pd_server(model_path, "kv_consumer", *ARGS, timeout_s=30, wait=False),
    )
    router = pd_router([prefill.url], [decode.url])
    try:
        want = text_of(httpx.post(f"{prefill.url}/v1/completions", json=body(model_path), timeout=60))

        def stream() -> list[str]:
            with httpx.stream("POST", f"{router.url}/v1/completions", json=body(model_path, stream=True)) as r:
                assert r.status_code == 200  # the decode instance's stream had begun (an empty one so far)
                return list(r.iter_lines())

        t, out = in_thread(stream)
        wait_until(lambda: usage(decode) > 0, what="the decode instance to allocate the blocks")
        kill_server(decode.proc.pid)
        t.join(30)
        # The stream ends with a clear error event, at once (not retried: the decode instance's answer had begun).
        events = out["value"]
        assert any('"error"' in e and "failed while streaming" in e for e in events), events
        assert out["seconds"] < 20
        # The push fails when it resumes; the lease ends and the blocks are freed.
        wait_kv_free(prefill.metrics, timeout=STALL_S + 10)
        # With no decode instance left, the prefill instance serves the next request whole.
        assert text_of(httpx.post(f"{router.url}/v1/completions", json=body(model_path), timeout=60)) == want
        wait_kv_free(prefill.metrics)
    finally:
        router.stop()
        decode.stop()
        prefill.stop()


def test_the_prefill_instance_killed_mid_transfer_across_namespaces(model_path):
    with veth_pair("pdf") as (a, b):
        prefill = NetnsProc(
            a,
            [
                "serve",
                "--model",
                model_path,
                *ARGS,
                "--kv-transfer-config",
                pd_transfer_config("kv_producer", a.ip, debug_push_stall_s=60),
            ],
            "prefill",
            wait=False,
        )
        decode = NetnsProc(
            b,
            [
                "serve",
                "--model",
                model_path,
                *ARGS,
                "--kv-transfer-config",
                pd_transfer_config("kv_consumer", b.ip, timeout_s=120),
            ],
            "decode",
            wait=False,
        )
        prefill, decode = all_healthy(prefill, decode)
        router = NetnsProc(
            b, ["router", "--prefill", prefill.url, "--decode", decode.url, "--health-interval", "0.5"], "router"
        )
        try:
            want = prefill.post("/v1/completions", body(model_path)).json()["choices"][0]["text"]
            t, out = in_thread(lambda: router.post("/v1/completions", body(model_path)))
            wait_until(
                lambda: metric(decode.text("/metrics"), "kvserve:kv_cache_usage_perc") > 0,
                what="the decode instance to allocate the blocks",
            )
            time.sleep(0.5)  # half of the bytes are on their way (the producer stalls for a minute after them)
            kill_server(prefill.proc.pid)
            t.join(60)
            # The decode instance sees the connection break, recomputes the prompt, and answers as one instance.
            assert text_of(out["value"]) == want
            assert out["seconds"] < 30
            d = decode.text("/metrics")
            assert transfer_stat(d, "remote_prefill_failures") == 1
            wait_kv_free(lambda: decode.text("/metrics"))
            # The router serves the next request (the decode instance computes it: no prefill instance is left).
            r = router.post("/v1/completions", body(model_path, "And now something else entirely"))
            assert r.status_code == 200 and r.json()["choices"][0]["text"]
            wait_kv_free(lambda: decode.text("/metrics"))
        finally:
            for proc in (router, decode, prefill):
                proc.stop()
