"""Instances, pool and index in two network namespaces joined by a veth pair, so every byte between them really
crosses an interface: namespace A holds instance a and the router, namespace B holds instance b, the Mooncake
master and storage node, and the index's Valkey. A prompt b computed is loaded by a from the pool across the veth,
token-identical; then faults: the pool's processes killed (a recomputes, same output), a client disconnecting
mid-stream, instance b killed mid-stream (its stream ends with an error; the router keeps serving with a). After
each, the surviving instances hold no KV blocks."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest

from kvserve.cluster.mooncake import MooncakeMaster, MooncakeStorageNode
from kvserve.cluster.valkey import ValkeyService
from kvserve.kv_transfer.common import mooncake
from tests.netns import Namespace, veth_pair

pytestmark = pytest.mark.skipif(not mooncake.available(), reason="Mooncake is not installed")

CLIENT = r"""
import json, sys, time, httpx
url, model, prompt, max_tokens, mode = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
out = {"status": None, "text": "", "error": None, "seconds": None}
start = time.time()
if mode == "plain":
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    out["status"] = r.status_code
    out["text"] = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
else:
    body["stream"] = True
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        out["status"] = r.status_code
        for i, line in enumerate(r.iter_lines()):
            if '"error"' in line:
                out["error"] = line
            elif line.startswith("data: {"):
                out["text"] += json.loads(line[6:])["choices"][0]["text"]
            if mode == "disconnect" and i == 3:
                break
out["seconds"] = time.time() - start
print(json.dumps(out))
"""

USAGE = r"""
import sys, httpx, re
text = httpx.get(sys.argv[1] + "/metrics", timeout=10).text
print(re.search(r'^kvserve:kv_cache_usage_perc\{[^}]*\} (\S+)$', text, re.M).group(1))
"""


def run_in(ns: Namespace, code: str, *args: str, timeout: float = 180) -> str:
    done = subprocess.run(ns.cmd([sys.executable, "-c", code, *args]), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def request(ns: Namespace, url: str, model: str, prompt: list[int], max_tokens: int = 8, mode: str = "plain") -> dict:
    return json.loads(run_in(ns, CLIENT, url, model, json.dumps(prompt), str(max_tokens), mode))


def usage(ns: Namespace, url: str) -> float:
    return float(run_in(ns, USAGE, url))


def wait_http(ns: Namespace, url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    code = "import sys, httpx; sys.exit(0 if httpx.get(sys.argv[1] + '/health', timeout=1).status_code == 200 else 1)"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"{url} exited"
        if subprocess.run(ns.cmd([sys.executable, "-c", code, url]), capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(url)


def serve(ns: Namespace, model: str, port: int, pool: dict) -> subprocess.Popen:
    argv = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--model", model, "--host", ns.ip]
    argv += ["--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB"]
    argv += ["--kv-transfer-config", json.dumps(pool)]
    argv += ["--kv-events-config", json.dumps({"endpoint": f"tcp://{ns.ip}:{port + 1}"})]
    return subprocess.Popen(ns.cmd(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_pool_and_router_across_namespaces(tiny_model_factory):
    model = tiny_model_factory("llama-gqa-untied")
    rng = random.Random(3)
    prompt = [rng.randrange(3, 40000) for _ in range(160)]
    procs: list[subprocess.Popen] = []
    services = []
    with veth_pair("kvc") as (a, b):
        try:
            master = MooncakeMaster(b.ip, netns=b.name)
            services += [master, MooncakeStorageNode(master.address, b.ip, segment="64 MB", netns=b.name)]
            index = ValkeyService(b.ip, netns=b.name)
            services.append(index)
            pool = {"kv_connector": "pool", "store": "mooncake", "master": master.address, "staging_bytes": "8MiB"}
            url_a, url_b = f"http://{a.ip}:8101", f"http://{b.ip}:8201"
            procs.append(serve(a, model, 8101, pool))
            procs.append(serve(b, model, 8201, pool))
            wait_http(a, url_a, procs[0])
            wait_http(b, url_b, procs[1])
            router_argv = [sys.executable, "-m", "kvserve.entrypoints.cli", "router", "--port", "8301"]
            router_argv += ["--instance", url_a, "--instance", url_b, "--policy", "cache_aware", "--model", model]
            router_argv += ["--index-url", index.url, "--health-interval", "0.5"]
            procs.append(subprocess.Popen(a.cmd(router_argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            router = "http://127.0.0.1:8301"
            wait_http(a, router, procs[2])

            # b computes the prompt (written through to the pool in B); a loads it across the veth.
            want = request(b, url_b, model, prompt)["text"]
            time.sleep(1.0)
            rx = a.bytes_received()
            got = request(a, url_a, model, prompt)
            assert got["text"] == want
            block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x block size x KV heads x head size x fp32
            assert a.bytes_received() - rx > 9 * block_bytes  # 9 full blocks of 16 crossed the interface

            # The pool's processes die: a's next load is a miss, recomputed: same output, bounded time.
            for service in services[:2]:
                service.kill()
            prompt2 = prompt[:80] + [rng.randrange(3, 40000) for _ in range(60)]
            want2 = request(b, url_b, model, prompt2)["text"]
            got2 = request(a, url_a, model, prompt2)
            assert got2["text"] == want2 and got2["seconds"] < 30

            # A client that disconnects mid-stream frees its blocks.
            cut = request(a, router, model, prompt2, max_tokens=200, mode="disconnect")
            assert cut["status"] == 200
            # Instance b dies: the router takes it out of rotation; a request ends (served by a, or cut with an error
            # if it was already on b) within a bounded time.
            procs[1].kill()
            ended = request(a, router, model, [7] * 20, max_tokens=200, mode="stream")
            assert ended["error"] or ended["text"], ended  # served by a (b is out of rotation) or cut with an error
            assert ended["seconds"] < 60
            # The router keeps serving with a; a holds no blocks afterwards.
            assert request(a, router, model, [9] * 30)["status"] == 200
            deadline = time.time() + 10
            while time.time() < deadline and usage(a, url_a) != 0.0:
                time.sleep(0.2)
            assert usage(a, url_a) == 0.0
        finally:
            for p in procs:
                p.kill()
                p.wait()
            for service in services:
                service.stop()
