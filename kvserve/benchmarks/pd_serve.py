"""`kvserve bench pd-serve`: tail latency under a mixed load, prefill/decode disaggregation against colocation, on the
same CPUs in the same run.

Two setups, each two `kvserve serve` instances pinned one per CPU (taskset, one compute thread each) behind
`kvserve router` (not pinned, like the load generator):
- colocated: two plain instances, round robin;
- disaggregated: a prefill instance (pd connector, kv_producer) and a decode instance (kv_consumer), `--prefill`
  / `--decode`; every request is prefilled on the first and decoded on the second, except prompts under
  `--direct-below` tokens, which the decode instance computes itself (the router's `--pd-direct-below`).
The workload mixes long prompts (`--long-len`, few output tokens) with short chats, Poisson arrivals at each
`--rates` value for about `--duration` seconds; the load generator is `kvserve bench serve`'s (streaming
completions; TTFT, ITL between streamed tokens). Reported per class (short / long): TTFT and ITL p50/p99, and the
goodput: requests per second that met the targets (TTFT <= --ttft-slo of their class and TPOT <= --itl-slo).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from kvserve.benchmarks.datasets import BenchRequest


@dataclass
class ClassStats:
    count: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_mean_ms: float
    good: int  # requests that met the targets


@dataclass
class RunResult:
    setup: str  # "colocated" | "disaggregated"
    rate: float
    duration_s: float
    by_class: dict[str, ClassStats]
    goodput: float  # good requests (every class) per second
    short_goodput: float


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * p
    lo, hi = math.floor(k), math.ceil(k)
    return (v[lo] + (v[hi] - v[lo]) * (k - lo)) * 1000


def workload(ns: argparse.Namespace, rate: float, tokenizer, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(ns.seed * 1000 + int(rate * 100))
    lo, hi = 1000, vocab_size - 1000
    out = []
    for _ in range(max(8, round(rate * ns.duration))):
        long = rng.random() < ns.long_fraction
        n = rng.randint(*(ns.long_len if long else ns.short_len))
        ids = [rng.randrange(lo, hi) for _ in range(n)]
        output = ns.long_output if long else rng.randint(*ns.short_output)
        # Token ids, not text: the lengths are exact (the router and both instances take token-id prompts).
        out.append(BenchRequest(ids, output, tag="long" if long else "short"))
    return out


def summarize(setup: str, rate: float, duration: float, results, ns: argparse.Namespace) -> RunResult:
    by_class = {}
    good_total = 0
    for tag in ("short", "long"):
        rs = [r for r in results if r.tag == tag]
        ok = [r for r in rs if r.error is None]
        slo = ns.ttft_slo_short if tag == "short" else ns.ttft_slo_long
        good = [r for r in ok if r.ttft * 1000 <= slo and (r.tpot is None or r.tpot * 1000 <= ns.itl_slo)]
        tpots = [r.tpot for r in ok if r.tpot is not None]
        by_class[tag] = ClassStats(
            count=len(rs),
            errors=len(rs) - len(ok),
            ttft_p50_ms=_pct([r.ttft for r in ok], 0.5),
            ttft_p99_ms=_pct([r.ttft for r in ok], 0.99),
            itl_p50_ms=_pct([x for r in ok for x in r.itls], 0.5),
            itl_p99_ms=_pct([x for r in ok for x in r.itls], 0.99),
            tpot_mean_ms=sum(tpots) / len(tpots) * 1000 if tpots else float("nan"),
            good=len(good),
        )
        good_total += len(good)
    return RunResult(setup, rate, duration, by_class, good_total / duration, by_class["short"].good / duration)


# ---------------------------------------------------------------------------------------------- processes


class Proc:
    def __init__(self, argv: list[str], name: str, cpu: int | None, log_dir: str) -> None:
        from kvserve.process_utils import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", *argv, "--port", str(self.port)]
        if cpu is not None:
            cmd = ["taskset", "-c", str(cpu), *cmd]
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.name = name

    def wait_healthy(self, timeout: float = 600) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited during start-up (see {self.log.name})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become healthy (see {self.log.name})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def start_setup(setup: str, ns: argparse.Namespace) -> list[Proc]:
    serve = ["serve", *ns.serve_args.split(), "--num-threads", "1", "--kv-cache-memory", ns.kv_cache_memory]
    if ns.model:
        serve += ["--model", ns.model]
    procs: list[Proc] = []
    try:
        if setup == "colocated":
            procs += [Proc(serve, f"{setup}-{i}", cpu, ns.log_dir) for i, cpu in enumerate(ns.cpus)]
            for p in procs:
                p.wait_healthy()
            router_args = ["router", "--policy", "round_robin", *[a for p in procs for a in ("--instance", p.url)]]
        else:
            roles = (("prefill", "kv_producer"), ("decode", "kv_consumer"))
            for (name, role), cpu in zip(roles, ns.cpus, strict=True):
                config = json.dumps(
                    {"kv_connector": "pd", "kv_role": role, "side_channel_host": "127.0.0.1", "transport": ns.transport}
                )
                procs.append(Proc([*serve, "--kv-transfer-config", config], f"{setup}-{name}", cpu, ns.log_dir))
            for p in procs:
                p.wait_healthy()
            router_args = ["router", "--prefill", procs[0].url, "--decode", procs[1].url]
            if ns.direct_below:
                router_args += ["--pd-direct-below", str(ns.direct_below)]
                router_args += ["--model", ns.model] if ns.model else []
        router = Proc(router_args, f"{setup}-router", None, ns.log_dir)
        procs.append(router)
        router.wait_healthy()
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def run_setup(setup: str, ns: argparse.Namespace, tokenizer, vocab_size: int) -> list[tuple[RunResult, list]]:
    from kvserve.benchmarks.serve import run_load

    procs = start_setup(setup, ns)
    router = procs[-1]
    out = []
    try:
        # Warm-up: every instance computes a long and a short prompt once (first-use costs stay out of the run).
        warm = workload(
            argparse.Namespace(**{**vars(ns), "duration": 4, "long_fraction": 0.5}), 1.0, tokenizer, vocab_size
        )
        asyncio.run(run_load(router.url, None, warm[:4], float("inf"), 2, ns.seed, "warm-up"))
        for rate in ns.rates:
            requests = workload(ns, rate, tokenizer, vocab_size)
            start = time.perf_counter()
            summary, results = asyncio.run(run_load(router.url, None, requests, rate, None, ns.seed, setup))
            duration = time.perf_counter() - start
            res = summarize(setup, rate, duration, results, ns)
            out.append((res, results))
            print_result(res)
    finally:
        for p in reversed(procs):
            p.stop()
    return out


def print_result(r: RunResult) -> None:
    print(
        f"== {r.setup}, {r.rate:g} req/s ({r.duration_s:.0f} s): goodput {r.goodput:.3f} req/s "
        f"(short chats {r.short_goodput:.3f})",
        flush=True,
    )
    for tag, c in r.by_class.items():
        print(
            f"   {tag:5s} n={c.count:3d} err={c.errors}  TTFT p50 {c.ttft_p50_ms:8.0f} p99 {c.ttft_p99_ms:8.0f} ms | "
            f"ITL p50 {c.itl_p50_ms:6.1f} p99 {c.itl_p99_ms:7.1f} ms | TPOT {c.tpot_mean_ms:6.1f} ms | "
            f"good {c.good}",
            flush=True,
        )


def plot(runs: list[dict], path: str) -> None:
    from kvserve.benchmarks.plots import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for setup, style in (("colocated", "o-"), ("disaggregated", "s-")):
        pts = sorted((r for r in runs if r["setup"] == setup), key=lambda r: r["rate"])
        rates = [r["rate"] for r in pts]
        short = [r["by_class"]["short"] for r in pts]
        axes[0].plot(rates, [c["itl_p99_ms"] for c in short], style, label=f"{setup}: p99")
        axes[0].plot(rates, [c["itl_p50_ms"] for c in short], style, alpha=0.4, label=f"{setup}: p50")
        axes[1].plot(rates, [c["ttft_p99_ms"] for c in short], style, label=f"{setup}: short p99")
        axes[1].plot(
            rates, [r["by_class"]["long"]["ttft_p99_ms"] for r in pts], style, alpha=0.4, label=f"{setup}: long p99"
        )
        axes[2].plot(rates, [r["short_goodput"] for r in pts], style, label=setup)
    axes[0].set_ylabel("short chats' ITL (ms)")
    axes[1].set_ylabel("TTFT (ms)")
    axes[2].set_ylabel("short chats' goodput (req/s)")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    _save(plt, fig, path, "1 prefill + 1 decode instance vs 2 colocated (one CPU each)")


def main(ns: argparse.Namespace) -> int:
    if ns.plot_only:
        runs = [r for path in ns.plot_only for r in json.load(open(path))]
        plot(runs, ns.plot)
        return 0
    from kvserve.loader.default_model import resolve_model_path
    from kvserve.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(ns.model or "smollm2-135m-instruct"))
    vocab_size = len(tokenizer)
    os.makedirs(ns.log_dir, exist_ok=True)
    print(
        f"pd-serve: rates {ns.rates} req/s, ~{ns.duration:g} s each, {ns.long_fraction:.0%} long prompts of "
        f"{ns.long_len[0]}-{ns.long_len[1]} tokens ({ns.long_output} out), short chats {ns.short_len[0]}-"
        f"{ns.short_len[1]} tokens ({ns.short_output[0]}-{ns.short_output[1]} out); targets: TTFT <= "
        f"{ns.ttft_slo_short:g} ms (short) / {ns.ttft_slo_long:g} ms (long), TPOT <= {ns.itl_slo:g} ms",
        flush=True,
    )
    runs = []
    for setup in ns.setups:
        for res, _ in run_setup(setup, ns, tokenizer, vocab_size):
            runs.append(asdict(res))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(runs, f, indent=2)
    if ns.plot:
        plot(runs, ns.plot)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("pd-serve", help="tail latency: prefill/decode disaggregation vs colocated instances")
    p.add_argument("--rates", type=float, nargs="+", default=[0.2, 0.4])
    p.add_argument("--duration", type=float, default=90, help="seconds of arrivals per rate")
    p.add_argument("--setups", nargs="+", default=["colocated", "disaggregated"])
    p.add_argument("--cpus", type=int, nargs=2, default=[0, 1], help="the two instances' CPUs")
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--serve-args", default="", help="more `kvserve serve` flags for every instance")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--transport", default="tcp", choices=("tcp", "mooncake"))
    p.add_argument(
        "--direct-below",
        type=int,
        default=0,
        help="disaggregated: the router sends prompts under this many tokens straight to the decode instance",
    )
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--long-len", type=int, nargs=2, default=[1536, 2048])
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--short-len", type=int, nargs=2, default=[32, 128])
    p.add_argument("--short-output", type=int, nargs=2, default=[48, 96])
    p.add_argument("--ttft-slo-short", type=float, default=2000.0, help="ms")
    p.add_argument("--ttft-slo-long", type=float, default=15000.0, help="ms")
    p.add_argument("--itl-slo", type=float, default=100.0, help="ms (TPOT target; also the ITL p99 target)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp/kvserve-pd-serve")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--plot-only", nargs="+", default=None, help="plot these --json files together; run nothing")
    p.set_defaults(func=main)
