"""`kvserve bench offload`: what the KV offload tiers and swap preemption buy, in one run (same-run ratios).

1. multi-turn TTFT: the multi-turn dataset (each turn resends the conversation) run turn by turn, one request at a
   time, on an engine as configured (its pool sized by --num-kv-blocks to a fraction of the working set), then on
   the same engine options plus the RAM + disk tiers (--cpu-bytes, a fresh directory under --disk-path).
2. restart: a fresh engine on the disk directory the tiers run filled answers one of the last-turn prompts (its
   first request), against a fresh engine with an empty directory (cold).
3. preemption: --swap-requests long decodes at once on a pool too small for them (--swap-kv-blocks), with
   recompute and with swap preemption: mean end-to-end latency of each.
Greedy outputs of every configuration are compared with the first (they must match token for token).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from kvserve.benchmarks.datasets import BenchRequest, build_dataset
from kvserve.benchmarks.throughput import add_dataset_args, dataset_spec, platform_line
from kvserve.engine.arg_utils import EngineArgs, add_cli_args


def _llm(args: EngineArgs):
    from kvserve.engine.llm import LLM

    return LLM.from_engine_args(args)


def _close(llm) -> None:
    llm.engine.engine_core.shutdown()  # lets the disk tier's queued writes finish
    del llm
    gc.collect()


def _one(llm, req: BenchRequest):
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": req.prompt_token_ids}, params, use_tqdm=False)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time, out.outputs[0].token_ids


def _multi_turn(llm, requests: list[BenchRequest]) -> dict:
    ttfts, tokens = [], []
    start = time.perf_counter()
    for req in requests:
        ttft, ids = _one(llm, req)
        ttfts.append(ttft)
        tokens.append(ids)
    return {
        "mean_ttft_ms": statistics.mean(ttfts) * 1000,
        "median_ttft_ms": statistics.median(ttfts) * 1000,
        "duration_s": time.perf_counter() - start,
        "stats": llm.stats(),
        "_tokens": tokens,
    }


def _preemption_load(llm, requests: list[BenchRequest]) -> dict:
    from kvserve.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    return {
        "mean_e2e_ms": statistics.mean(o.metrics.finished_time - o.metrics.arrival_time for o in outs) * 1000,
        "duration_s": time.perf_counter() - start,
        "num_preemptions": stats["num_preemptions"],
        "num_swapped_out": stats["num_swapped_out"],
        "num_swap_fallbacks": stats["num_swap_fallbacks"],
        "_tokens": [o.outputs[0].token_ids for o in outs],
    }


def main(ns: argparse.Namespace) -> int:
    base = EngineArgs.from_cli_args(ns)
    base.kv_transfer_config = None
    disk_root = tempfile.mkdtemp(prefix="kvserve-bench-offload-", dir=ns.disk_path)
    tiers = {"kv_connector": "offload", "cpu_bytes": ns.cpu_bytes, "disk_path": os.path.join(disk_root, "warm")}
    results: dict = {}
    try:
        llm = _llm(base)
        print(platform_line(llm.engine.config.model.dtype))
        vocab = llm.engine.config.model.arch.vocab_size
        requests = build_dataset(dataset_spec(ns), vocab)
        pool_tokens = llm.stats()["num_blocks"] * llm.stats()["block_size"]
        working_set = sum(
            len(r.prompt_token_ids) + r.output_len for r in requests[-max(1, ns.num_requests // ns.turns) :]
        )
        print(
            f"multi-turn: {len(requests)} requests, working set {working_set} tokens = "
            f"{working_set / pool_tokens:.1f}x the pool"
        )
        results["pool_tokens"], results["working_set_tokens"] = pool_tokens, working_set

        results["no_tiers"] = _multi_turn(llm, requests)
        _close(llm)
        llm = _llm(dataclasses.replace(base, kv_transfer_config=tiers))
        results["tiers"] = _multi_turn(llm, requests)
        _close(llm)

        # Restart on the warm directory vs a cold (empty) one: a fresh engine's first request.
        probe = requests[-1]
        cold = dict(tiers, disk_path=os.path.join(disk_root, "cold"))
        llm = _llm(dataclasses.replace(base, kv_transfer_config=cold))
        results["restart_cold_ttft_ms"], cold_ids = (lambda t: (t[0] * 1000, t[1]))(_one(llm, probe))
        _close(llm)
        llm = _llm(dataclasses.replace(base, kv_transfer_config=tiers))
        results["restart_warm_ttft_ms"], warm_ids = (lambda t: (t[0] * 1000, t[1]))(_one(llm, probe))
        results["restart_warm_stats"] = llm.stats()["kv_transfer"]
        _close(llm)
        results["restart_identical"] = cold_ids == warm_ids == results["no_tiers"]["_tokens"][-1]

        # Swap vs recompute under a pool too small for the batch.
        swap_reqs = build_dataset(
            dataclasses.replace(
                dataset_spec(ns),
                name="random",
                num_requests=ns.swap_requests,
                input_len=(64, 128),
                output_len=(96, 128),
            ),
            vocab,
        )
        for mode in ("recompute", "swap"):
            small = dataclasses.replace(base, num_kv_blocks=ns.swap_kv_blocks, preemption_mode=mode)
            llm = _llm(small)
            results[f"preempt_{mode}"] = _preemption_load(llm, swap_reqs)
            _close(llm)
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)

    a, b = results["no_tiers"], results["tiers"]
    results["identical_tiers"] = a["_tokens"] == b["_tokens"]
    results["identical_preemption"] = results["preempt_recompute"]["_tokens"] == results["preempt_swap"]["_tokens"]
    results["ttft_ratio"] = a["mean_ttft_ms"] / b["mean_ttft_ms"]
    results["restart_ratio"] = results["restart_cold_ttft_ms"] / results["restart_warm_ttft_ms"]
    print(
        f"multi-turn mean TTFT: no tiers {a['mean_ttft_ms']:.1f} ms, RAM+disk tiers {b['mean_ttft_ms']:.1f} ms "
        f"({results['ttft_ratio']:.2f}x lower); outputs identical: {results['identical_tiers']}"
    )
    kv = b["stats"]["kv_transfer"]
    print(
        f"  tiers: RAM hits {kv['ram_hit_blocks']:.0f} blocks, disk hits {kv['disk_hit_blocks']:.0f}, misses "
        f"{kv['miss_blocks']:.0f}, loaded {kv.get('ram_loaded_bytes', 0) / 2**20:.0f} MiB "
        f"in {kv.get('load_time_s', 0):.2f} s, "
        f"saved {kv.get('ram_saved_bytes', 0) / 2**20:.0f} MiB in {kv.get('save_time_s', 0):.2f} s"
    )
    print(
        f"restart, first request TTFT: cold {results['restart_cold_ttft_ms']:.1f} ms, warm disk "
        f"{results['restart_warm_ttft_ms']:.1f} ms ({results['restart_ratio']:.2f}x lower); identical: "
        f"{results['restart_identical']}"
    )
    for mode in ("recompute", "swap"):
        r = results[f"preempt_{mode}"]
        print(
            f"preemption by {mode}: mean e2e {r['mean_e2e_ms']:.0f} ms, {r['num_preemptions']} preemptions "
            f"({r['num_swapped_out']} swapped, {r['num_swap_fallbacks']} fell back), {r['duration_s']:.1f} s"
        )
    print(f"  outputs identical: {results['identical_preemption']}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(_strip(results), f, indent=2)
    ok = results["identical_tiers"] and results["restart_identical"] and results["identical_preemption"]
    return 0 if ok else 1


def _strip(d):
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if not k.startswith("_")}
    return d


def add_parser(sub) -> None:
    p = sub.add_parser("offload", help="KV offload tiers (multi-turn TTFT, restart) and swap vs recompute preemption")
    p.add_argument("--cpu-bytes", default="2GiB", help="RAM tier budget of the tiers runs")
    p.add_argument("--disk-path", default=None, help="where the disk tier's temporary directory goes (default: /tmp)")
    p.add_argument("--swap-requests", type=int, default=12, help="preemption load: requests at once")
    p.add_argument("--swap-kv-blocks", type=int, default=32, help="preemption load: KV pool blocks")
    p.add_argument("--json", default=None)
    add_dataset_args(p, default="multi-turn", with_seed=False)
    add_cli_args(p)
    p.set_defaults(func=main)


if __name__ == "__main__":
    sys.exit(main(argparse.ArgumentParser().parse_args()))
