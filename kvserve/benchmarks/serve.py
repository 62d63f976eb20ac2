"""`kvserve bench serve`: load an OpenAI-compatible /v1/completions endpoint (kvserve, llama.cpp's llama-server,
vLLM) with streaming requests and measure latency and throughput, like `vllm bench serve`.

Requests arrive as a Poisson process at --request-rate (inf = all at once), at most --max-concurrency in flight.
Per request: TTFT (first streamed token), ITL (gaps between streamed tokens), TPOT ((e2e - TTFT) / (tokens - 1)).
If the server exposes kvserve's Prometheus metrics, the prefix-cache hit rate over the run is reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from kvserve.benchmarks.datasets import BenchRequest, build_dataset
from kvserve.benchmarks.throughput import add_dataset_args, dataset_spec


@dataclass
class RequestResult:
    tag: str
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


@dataclass
class Summary:
    label: str
    request_rate: float
    max_concurrency: int | None
    duration_s: float
    completed: int
    errors: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    latency_ms: dict[str, dict[str, float]]  # metric -> {mean, median, p90, p99}
    by_tag: dict[str, dict[str, dict[str, float]]]
    prefix_cache_hit_rate: float | None = None


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p90": float("nan"), "p99": float("nan")}
    v = sorted(values)

    def pct(p: float) -> float:
        k = (len(v) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return (v[lo] + (v[hi] - v[lo]) * (k - lo)) * 1000

    return {"mean": sum(v) / len(v) * 1000, "median": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def _latencies(results: list[RequestResult]) -> dict[str, dict[str, float]]:
    ok = [r for r in results if r.error is None]
    return {
        "ttft": _stats([r.ttft for r in ok]),
        "tpot": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": _stats([x for r in ok for x in r.itls]),
        "e2e": _stats([r.e2e for r in ok]),
    }


async def _one(session, url: str, model: str | None, req: BenchRequest, extra: dict) -> RequestResult:
    import aiohttp

    result = RequestResult(req.tag, req.prompt_len)
    body = {
        "prompt": req.prompt_text if req.prompt_text is not None else req.prompt_token_ids,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        **extra,
    }
    if model:
        body["model"] = model
    start = time.perf_counter()
    last = start
    chunks = 0
    usage_tokens = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    result.error = str(msg["error"])[:200]
                    return result
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens")
                choices = msg.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                    chunks += 1
    except (TimeoutError, aiohttp.ClientError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_len = usage_tokens if usage_tokens is not None else chunks
    if chunks == 0:
        result.error = "no tokens streamed"
    return result


async def _scrape_prefix_counters(session, base_url: str) -> tuple[float, float] | None:
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except Exception:
        return None
    queries = hits = None
    for line in text.splitlines():
        if line.startswith("kvserve:prefix_cache_queries_total"):
            queries = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvserve:prefix_cache_hits_total"):
            hits = float(line.rsplit(" ", 1)[1])
    return (queries, hits) if queries is not None and hits is not None else None


async def run_load(
    base_url: str,
    model: str | None,
    requests: list[BenchRequest],
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    label: str = "",
    extra: dict | None = None,
) -> tuple[Summary, list[RequestResult]]:
    import aiohttp

    url = f"{base_url.rstrip('/')}/v1/completions"
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    # A fresh connection per request: llama.cpp's server closes kept-alive connections after a few requests, and
    # a request sent on one it is closing fails with "Server disconnected".
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        before = await _scrape_prefix_counters(session, base_url)

        async def limited(req: BenchRequest) -> RequestResult:
            async with limit:
                return await _one(session, url, model, req, extra or {})

        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await _scrape_prefix_counters(session, base_url)

    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_len for r in ok)
    hit_rate = None
    if before and after and after[0] > before[0]:
        hit_rate = (after[1] - before[1]) / (after[0] - before[0])
    summary = Summary(
        label=label,
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        duration_s=duration,
        completed=len(ok),
        errors=len(results) - len(ok),
        request_throughput=len(ok) / duration,
        output_throughput=out_tokens / duration,
        total_token_throughput=(out_tokens + sum(r.prompt_len for r in ok)) / duration,
        latency_ms=_latencies(results),
        by_tag={tag: _latencies([r for r in results if r.tag == tag]) for tag in sorted({r.tag for r in results})},
        prefix_cache_hit_rate=hit_rate,
    )
    return summary, results


def print_summary(s: Summary) -> None:
    rate = "inf" if s.request_rate == float("inf") else f"{s.request_rate:g}"
    print(f"== {s.label or 'serve'}: rate {rate} req/s, max concurrency {s.max_concurrency or '-'} ==")
    print(f"  completed {s.completed}, errors {s.errors}, duration {s.duration_s:.1f} s")
    print(
        f"  request throughput {s.request_throughput:.2f} req/s, output {s.output_throughput:.1f} tok/s, "
        f"total {s.total_token_throughput:.1f} tok/s"
    )
    if s.prefix_cache_hit_rate is not None:
        print(f"  prefix cache hit rate (server, tokens) {s.prefix_cache_hit_rate:.1%}")
    for metric, st in s.latency_ms.items():
        print(
            f"  {metric.upper():5s} ms  mean {st['mean']:8.1f}  median {st['median']:8.1f}  "
            f"p90 {st['p90']:8.1f}  p99 {st['p99']:8.1f}"
        )
    if len(s.by_tag) > 1:
        for tag, lat in s.by_tag.items():
            itl, ttft = lat["itl"], lat["ttft"]
            print(f"  [{tag}] TTFT mean {ttft['mean']:.1f} ms, ITL mean {itl['mean']:.1f} p99 {itl['p99']:.1f} ms")


def main(ns: argparse.Namespace) -> int:
    tokenizer = None
    if ns.tokenizer or ns.model_for_tokenizer:
        from kvserve.loader.default_model import resolve_model_path
        from kvserve.loader.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(ns.tokenizer or resolve_model_path(ns.model_for_tokenizer))
    if tokenizer is None:
        raise SystemExit("a tokenizer is needed to build text prompts: pass --tokenizer or --model-for-tokenizer")
    requests = build_dataset(dataset_spec(ns), len(tokenizer), tokenizer)
    rates = ns.sweep or [ns.request_rate]
    summaries, all_results = [], []
    for rate in rates:
        summary, results = asyncio.run(
            run_load(ns.base_url, ns.model, requests, rate, ns.max_concurrency, ns.seed, ns.label)
        )
        print_summary(summary)
        summaries.append(summary)
        all_results.append(results)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump([asdict(s) for s in summaries], f, indent=2, default=str)
    if ns.plot:
        from kvserve.benchmarks.plots import plot_latency_distributions, plot_sweep

        if len(summaries) > 1:
            plot_sweep(summaries, ns.plot)
        else:
            plot_latency_distributions({ns.label or "serve": all_results[0]}, ns.plot)
    return 0 if all(s.errors == 0 for s in summaries) else 1


def parse_rate(text: str) -> float:
    return float("inf") if text.lower() in ("inf", "infinity") else float(text)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load an OpenAI-compatible server and report TTFT/TPOT/ITL/throughput")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="value of the request's `model` field")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or .gguf for building text prompts")
    p.add_argument(
        "--model-for-tokenizer",
        default="smollm2-135m-instruct",
        help="model whose tokenizer builds the prompts (default: the embedded model)",
    )
    p.add_argument("--request-rate", type=parse_rate, default=float("inf"), help="requests/s (Poisson), or inf")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--sweep", type=parse_rate, nargs="*", default=None, help="run once per request rate")
    p.add_argument("--label", default="", help="name of this run in the output")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG: latency distributions (or sweep curves)")
    add_dataset_args(p)
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(main(argparse.ArgumentParser().parse_args()))
