"""Benchmarks of KV shared between instances, each on a local cluster it starts itself (kvserve/cluster/launch.py):

- `kvserve bench pool`: the cross-instance hit. Instance A computes a long prompt (its blocks written through to
  the pool); instance B then answers the same prompt loading them from the pool. B's time to first token against
  B recomputing a prompt of the same length, and B's output against A's, over --repeat prompts.
- `kvserve bench routing`: a multi-turn chat workload (conversations sharing a system prompt, each turn resending
  the history with the model's own replies, each conversation waiting for its reply before its next turn) through
  the router, once per
  configuration (policy and pool); hit rates by tier (the instances' own caches, the pool, recomputed), TTFT
  mean and p99, and output throughput, in one table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

from kvserve.benchmarks.serve import _stats
from kvserve.cluster.launch import ClusterConfig, LocalCluster


def scrape(url: str) -> dict[str, float]:
    """An instance's counters: prefix-cache queries and hits (tokens), and its connector's stats."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^kvserve:(prefix_cache_queries_total|prefix_cache_hits_total)\{[^}]*\} (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
            continue
        m = re.match(r'^kvserve:kv_transfer\{[^}]*stat="([^"]+)"[^}]*\} (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def router_reasons(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for m in re.finditer(r'^kvserve_router_requests_total\{[^}]*reason="([^"]+)"[^}]*\} (\S+)$', text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


@dataclass
class _Turn:
    ttft: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    error: str | None = None


async def _stream(session, url: str, prompt: list[int], max_tokens: int) -> _Turn:
    """One streamed completion: its time to first token and its generated token ids (return_token_ids)."""
    import aiohttp

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    body["return_token_ids"] = True
    turn, start = _Turn(), time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                turn.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return turn
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    turn.error = str(msg["error"])[:200]
                    return turn
                for choice in msg.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids and not turn.output_ids:
                        turn.ttft = time.perf_counter() - start
                    turn.output_ids += ids
    except (TimeoutError, aiohttp.ClientError) as e:
        turn.error = f"{type(e).__name__}: {e}"
    if not turn.output_ids and turn.error is None:
        turn.error = "no tokens streamed"
    return turn


def _complete(url: str, prompt: list[int], max_tokens: int) -> tuple[float, str]:
    """(time to first token, the text), streamed."""
    chunks, start, first = [], time.perf_counter(), None
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text = json.loads(line[6:])["choices"][0]["text"]
                if text and first is None:
                    first = time.perf_counter() - start
                chunks.append(text)
    return first or float("nan"), "".join(chunks)


def _wait_quiet(url: str, key: str, settle_s: float = 0.5, timeout_s: float = 30) -> None:
    """Until the instance's connector counter `key` stops moving (its background saves are done)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        now = scrape(url).get(key)
        if now is not None and now == last:
            return
        last = now
        time.sleep(settle_s)


# ------------------------------------------------------------------ kvserve bench pool


def run_pool(ns: argparse.Namespace) -> int:
    serve_args = ["--dtype", ns.dtype] if ns.dtype else []
    config = ClusterConfig(2, ns.model, pool=ns.pool, policy="round_robin", serve_args=serve_args, router=False)
    cluster = LocalCluster(config).start()
    a, b = cluster.instance_urls
    rng = random.Random(ns.seed)
    rows = []
    try:
        _complete(b, _tokens(rng, 64), 2)  # warm both (kernels, pages)
        _complete(a, _tokens(rng, 64), 2)
        for i in range(ns.repeat):
            fresh, shared = _tokens(rng, ns.prompt_len), _tokens(rng, ns.prompt_len)
            ttft_recompute, _ = _complete(b, fresh, ns.output_len)
            _, text_a = _complete(a, shared, ns.output_len)
            _wait_quiet(a, "saved_blocks")
            before = scrape(b)
            ttft_pool, text_b = _complete(b, shared, ns.output_len)
            loaded = scrape(b).get("loaded_blocks", 0) - before.get("loaded_blocks", 0)
            rows.append(
                {
                    "ttft_recompute_ms": ttft_recompute * 1e3,
                    "ttft_pool_ms": ttft_pool * 1e3,
                    "loaded_blocks": loaded,
                    "same_output": text_a == text_b,
                }
            )
            print(
                f"prompt {i}: recompute {ttft_recompute * 1e3:.0f} ms, from the pool {ttft_pool * 1e3:.0f} ms "
                f"({loaded:.0f} blocks), same output: {text_a == text_b}",
                flush=True,
            )
    finally:
        cluster.stop()
    rec = statistics.median(r["ttft_recompute_ms"] for r in rows)
    pool = statistics.median(r["ttft_pool_ms"] for r in rows)
    print(
        f"median TTFT: recompute {rec:.0f} ms, pool {pool:.0f} ms: {rec / pool:.1f}x lower; "
        f"same output {sum(r['same_output'] for r in rows)}/{len(rows)}"
    )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": vars(ns) | {"func": None}, "rows": rows, "speedup": rec / pool}, f, indent=2)
    return 0


# ------------------------------------------------------------------ kvserve bench routing


@dataclass
class RoutingResult:
    config: str
    requests: int
    errors: int
    duration_s: float
    output_tok_s: float
    ttft_mean_ms: float
    ttft_p99_ms: float
    hit_local: float  # fraction of prompt tokens found in the instance's own prefix cache
    hit_pool: float  # ... loaded from the shared pool
    miss: float  # ... computed
    reasons: dict[str, float]  # the router's decisions by reason (cache, balance, round_robin, ...)


def _conversations(ns: argparse.Namespace) -> list[list[tuple[list[int], int]]]:
    """Per conversation, its turns as (new user tokens, reply length); the system prompt is shared by all."""
    rng = random.Random(ns.seed)
    return [
        [(_tokens(rng, rng.randint(*ns.user_len)), rng.randint(*ns.reply_len)) for _ in range(ns.turns)]
        for _ in range(ns.conversations)
    ]


async def _chat_load(router: str, system: list[int], conversations, concurrency: int) -> tuple[list[_Turn], float]:
    """Every conversation in turn order, each turn sent once the previous one's reply is in; a turn resends the
    history: the system prompt, every earlier user message and the model's own replies (their token ids, as a
    chat client resends the assistant's messages)."""
    import aiohttp

    limit = asyncio.Semaphore(concurrency)
    results: list[_Turn] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def conversation(turns):
            history = list(system)
            for user, reply_len in turns:
                prompt = history + user
                async with limit:
                    turn = await _stream(session, router, prompt, reply_len)
                results.append(turn)
                history = prompt + turn.output_ids

        start = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in conversations))
        return results, time.perf_counter() - start


def run_routing(ns: argparse.Namespace) -> int:
    rng = random.Random(ns.seed + 1)
    system = _tokens(rng, ns.system_len)
    conversations = _conversations(ns)
    out: list[RoutingResult] = []
    for spec in ns.configs:
        policy, _, pool = spec.partition(":")
        serve_args = ["--dtype", ns.dtype] if ns.dtype else []
        config = ClusterConfig(2, ns.model, pool=pool or "none", policy=policy, serve_args=serve_args)
        cluster = LocalCluster(config).start()
        try:
            before = [scrape(u) for u in cluster.instance_urls]
            results, duration = asyncio.run(_chat_load(cluster.router_url, system, conversations, ns.concurrency))
            after = [scrape(u) for u in cluster.instance_urls]
            reasons = router_reasons(cluster.router_url)
        finally:
            cluster.stop()
        queries = sum(
            x.get("prefix_cache_queries_total", 0) - y.get("prefix_cache_queries_total", 0)
            for x, y in zip(after, before, strict=True)
        )
        local = sum(
            x.get("prefix_cache_hits_total", 0) - y.get("prefix_cache_hits_total", 0)
            for x, y in zip(after, before, strict=True)
        )
        pooled = ns.block_size * sum(
            x.get("loaded_blocks", 0) - y.get("loaded_blocks", 0) for x, y in zip(after, before, strict=True)
        )
        ok = [r for r in results if r.error is None]
        ttft = _stats([r.ttft for r in ok])
        out_tokens = sum(len(r.output_ids) for r in ok)
        row = RoutingResult(
            spec,
            len(results),
            len(results) - len(ok),
            duration,
            out_tokens / duration,
            ttft["mean"],
            ttft["p99"],
            local / queries if queries else 0.0,
            pooled / queries if queries else 0.0,
            max(0.0, 1 - (local + pooled) / queries) if queries else 0.0,
            reasons,
        )
        out.append(row)
        print(f"{spec}: {row}", flush=True)
    header = ("config", "local", "pool", "miss", "TTFT mean", "TTFT p99", "out tok/s")
    print("\n" + f"{header[0]:28s}" + "".join(f" {h:>10s}" for h in header[1:]))
    for r in out:
        print(
            f"{r.config:28s} {r.hit_local:10.1%} {r.hit_pool:10.1%} {r.miss:10.1%} {r.ttft_mean_ms:10.0f} "
            f"{r.ttft_p99_ms:10.0f} {r.output_tok_s:10.1f}"
        )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump([asdict(r) for r in out], f, indent=2)
    return 0 if all(r.errors == 0 for r in out) else 1


# ------------------------------------------------------------------ parsers


def add_parsers(sub) -> None:
    p = sub.add_parser("pool", help="cross-instance hits: TTFT loading a prompt from the shared pool vs recomputing")
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--dtype", default=None, help="the instances' dtype (default: the CPU's)")
    p.add_argument("--pool", choices=["mooncake", "valkey"], default="mooncake")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run_pool)

    r = sub.add_parser("routing", help="multi-turn chat over 2 instances: routing policies with and without the pool")
    r.add_argument("--model", default=None, help="default: the embedded model")
    r.add_argument("--dtype", default=None)
    r.add_argument(
        "--configs",
        nargs="+",
        default=["cache_aware:none", "round_robin:none", "round_robin:mooncake"],
        help="policy:pool pairs (pool: none, mooncake or valkey)",
    )
    r.add_argument("--conversations", type=int, default=32)
    r.add_argument("--turns", type=int, default=6)
    r.add_argument("--system-len", type=int, default=256)
    r.add_argument("--user-len", type=int, nargs=2, default=(32, 96))
    r.add_argument("--reply-len", type=int, nargs=2, default=(96, 192))
    r.add_argument("--concurrency", type=int, default=8, help="most requests in flight")
    r.add_argument("--block-size", type=int, default=16, help="the instances' block size")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", default=None)
    r.set_defaults(func=run_routing)
