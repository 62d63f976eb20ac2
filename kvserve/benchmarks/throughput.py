"""`kvserve bench throughput`: offline throughput, like `vllm bench throughput`.

Runs a dataset through kvserve's offline engine and, with --hf-batch-sizes, through HF transformers `generate`
with static batches (left-padded, prompts sorted by length; each batch decodes until its longest request is done
and only each request's own output tokens count) on the same model, dtype and workload, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

from kvserve.benchmarks.competing_load import CompetingLoad
from kvserve.benchmarks.datasets import DATASETS, BenchRequest, DatasetSpec, build_dataset
from kvserve.benchmarks.openvino_peer import (
    add_openvino_args,
    engine_threads,
    openvino_name,
    openvino_properties,
    openvino_summary,
    run_openvino,
)
from kvserve.engine.arg_utils import EngineArgs, add_cli_args
from kvserve.platform import platform_record, startup_summary


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def platform_line(dtype: str) -> str:
    """The CPU, its ISA level and features, threads and dtype: every benchmark prints it first."""
    from kvserve.kernels.cpu import kernel_isa, load_cpu_kernels

    kernels = f"C++ {kernel_isa()}" if load_cpu_kernels() is not None else "pure torch"
    return startup_summary(dtype, torch_threads(), kernels)


@dataclass
class ThroughputResult:
    name: str
    seconds: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
        }


def run_kvserve(llm, requests: list[BenchRequest], name: str = "kvserve", temperature: float = 1.0) -> ThroughputResult:
    from kvserve.sampling_params import SamplingParams

    params = [
        SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=True, seed=i)
        for i, r in enumerate(requests)
    ]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(r.output_len for r in requests)
    assert produced == expected, f"produced {produced} tokens, expected {expected}"
    return ThroughputResult(name, seconds, len(requests), sum(r.prompt_len for r in requests), produced)


def load_hf_model(model_path: str, dtype: str):
    import torch
    import transformers

    torch_dtype = getattr(torch, dtype)
    if model_path.endswith(".gguf"):
        # Dense weights, like kvserve's; transformers would otherwise keep GGUF blocks and run its own fp32 kernels.
        folder, name = os.path.split(model_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch_dtype, quantization_config=transformers.GgufConfig(dequantize=True)
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    return model.eval()


def run_hf(
    model, requests: list[BenchRequest], batch_size: int, pad_id: int, temperature: float = 1.0
) -> ThroughputResult:
    """HF `generate` in static batches on the model's device."""
    import torch

    device = next(model.parameters()).device

    order = sorted(range(len(requests)), key=lambda i: requests[i].prompt_len)  # less padding: a fair baseline
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(requests[i].prompt_len for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = requests[i].prompt_token_ids
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(requests[i].output_len for i in idx)
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                pad_token_id=pad_id,
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return ThroughputResult(
        f"hf-generate-bs{batch_size}",
        seconds,
        len(requests),
        sum(r.prompt_len for r in requests),
        sum(r.output_len for r in requests),
    )


def add_dataset_args(p: argparse.ArgumentParser, default: str = "random", with_seed: bool = True) -> None:
    """Dataset flags. `with_seed=False` when the parser gets the engine's --seed, which then seeds both."""
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=DATASETS, default=default)
    g.add_argument("--num-requests", type=int, default=128)
    g.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=[64, 512],
        metavar=("MIN", "MAX"),
        help="prompt length range (shared-prefix: the unique suffix; multi-turn: each user message)",
    )
    g.add_argument("--output-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    if with_seed:
        g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt length")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument("--num-long", type=int, default=4, help="long-prompt: number of long prompts")
    g.add_argument("--long-len", type=int, nargs=2, default=[2048, 3072], metavar=("MIN", "MAX"))


def dataset_spec(ns: argparse.Namespace) -> DatasetSpec:
    return DatasetSpec(
        name=ns.dataset,
        num_requests=ns.num_requests,
        seed=ns.seed,
        input_len=tuple(ns.input_len),
        output_len=tuple(ns.output_len),
        options={
            "prefix_len": ns.prefix_len,
            "num_prefixes": ns.num_prefixes,
            "turns": ns.turns,
            "num_long": ns.num_long,
            "long_len": tuple(ns.long_len),
        },
    )


def main(ns: argparse.Namespace) -> int:
    from kvserve.engine.llm import LLM
    from kvserve.loader.default_model import resolve_model_path

    args = EngineArgs.from_cli_args(ns)
    t0 = time.perf_counter()
    llm = LLM.from_engine_args(args)
    print(f"kvserve loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    llm_config = llm.engine.config
    dtype = llm_config.model.dtype
    print(platform_line(dtype))
    vocab = llm.engine.config.model.arch.vocab_size
    requests = build_dataset(dataset_spec(ns), vocab, llm.get_tokenizer() if ns.dataset in ("copy", "chat") else None)
    print(
        f"{ns.dataset}: {len(requests)} requests, {sum(r.prompt_len for r in requests)} prompt + "
        f"{sum(r.output_len for r in requests)} output tokens",
        file=sys.stderr,
    )

    # kvserve as configured, then once per --ablate with that feature off. --repeat runs the configurations in
    # ABBA order (drift of the machine hits them alike) and reports each one's median run (the lower middle one
    # for an even count); every run is in the JSON. --competing-load K times each run twice on the same engine:
    # idle, then beside K busy processes ("<name> (load K)").
    configs = [("kvserve", args)]
    for feature in ns.ablate:
        if feature == "speculative":
            configs.append(("kvserve (speculative off)", replace(args, speculative_config=None)))
            continue
        if feature == "deterministic":
            configs.append(("kvserve (deterministic off)", replace(args, deterministic=False)))
            continue
        field = "enable_" + feature.replace("-", "_")
        configs.append((f"kvserve ({feature} off)", replace(args, **{field: False})))
    loaded_name = f" (load {ns.competing_load})"
    names = [name for name, _ in configs]
    if ns.competing_load:
        names += [name + loaded_name for name, _ in configs]
    runs: dict[str, list[ThroughputResult]] = {name: [] for name in names}
    stats: dict[str, dict] = {}
    for rep in range(ns.repeat):
        for name, cfg in configs if rep % 2 == 0 else configs[::-1]:
            if llm is None:
                llm = LLM.from_engine_args(cfg)
            # A long-running server has touched its whole KV pool once (`kvserve serve` does it in the background
            # at start-up); fault it in before timing rather than charge the first pass to this run.
            llm.engine.engine_core.executor.collective_rpc("prefault_kv_cache")
            # Warm-up outside the timing: allocator, oneDNN kernel selection.
            warm = DatasetSpec("random", num_requests=8, seed=ns.seed + 1, input_len=(64, 128), output_len=(8, 16))
            run_kvserve(llm, build_dataset(warm, vocab), "warmup", ns.temperature)
            before = llm.stats().get("spec_decoding")
            r = run_kvserve(llm, requests, name, ns.temperature)
            print(f"{name}: {r.output_tokens_per_s:.1f} output tok/s", file=sys.stderr)
            runs[name].append(r)
            if name not in stats:
                stats[name] = llm.stats()
                if before is not None:
                    stats[name]["spec_decoding_this_run"] = _spec_delta(before, stats[name]["spec_decoding"])
            if ns.competing_load:
                # The same requests again: forget their cached prefixes, which would otherwise make this run cheaper.
                llm.reset_prefix_cache()
                with CompetingLoad(ns.competing_load):
                    r = run_kvserve(llm, requests, name + loaded_name, ns.temperature)
                print(f"{r.name}: {r.output_tokens_per_s:.1f} output tok/s", file=sys.stderr)
                runs[r.name].append(r)
            llm = None  # frees the engine and its KV cache before the next configuration loads
    results = [sorted(runs[name], key=lambda r: r.seconds)[(len(runs[name]) - 1) // 2] for name in names]

    if ns.hf_batch_sizes:
        hf = load_hf_model(resolve_model_path(ns.model), dtype)
        pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
        for bs in ns.hf_batch_sizes:
            r = run_hf(hf, requests, bs, pad)
            print(f"{r.name}: {r.output_tokens_per_s:.1f} output tok/s", file=sys.stderr)
            results.append(r)

    if ns.openvino:
        results.append(run_openvino_offline(ns, llm_config, requests))
        print(f"{results[-1].name}: {results[-1].output_tokens_per_s:.1f} output tok/s", file=sys.stderr)

    print_results(results)
    for name, st in stats.items():
        spec = st.get("spec_decoding_this_run")
        if spec is not None:
            print(
                f"{name}: speculation acceptance rate {spec['acceptance_rate']:.3f}, mean acceptance length "
                f"{spec['mean_acceptance_length']:.2f} ({spec['num_draft_tokens']} draft tokens in "
                f"{spec['num_drafts']} drafts)"
            )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(
                {
                    "platform": platform_record(dtype, torch_threads()),
                    "dataset": asdict(dataset_spec(ns)),
                    "results": [r.to_dict() for r in results],
                    "kvserve_runs": {name: [r.to_dict() for r in rs] for name, rs in runs.items()},
                    "kvserve_stats": stats.get(configs[0][0]),
                    "kvserve_stats_by_config": stats,
                },
                f,
                indent=2,
            )
    return 0


def run_openvino_offline(ns: argparse.Namespace, config, requests: list[BenchRequest]) -> ThroughputResult:
    """The same requests through OpenVINO GenAI's ContinuousBatchingPipeline, with kvserve's scheduling limits."""
    props = openvino_properties(ns.openvino_precision, config.model.dtype, engine_threads(config), ns.openvino_property)
    warm = DatasetSpec("random", num_requests=8, seed=ns.seed + 1, input_len=(64, 128), output_len=(8, 16))
    job = {
        "mode": "offline",
        "model_dir": ns.openvino,
        "properties": props,
        "temperature": ns.temperature,
        "seed": ns.seed,
        "scheduler": {
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "cache_size": ns.openvino_cache_gb,
            "enable_prefix_caching": False,  # random prompts share nothing; kvserve's cache costs it ~nothing here
        },
        "warmup": [[r.prompt_token_ids, r.output_len] for r in build_dataset(warm, config.model.arch.vocab_size)],
        "requests": [[r.prompt_token_ids, r.output_len] for r in requests],
    }
    out = run_openvino(ns.openvino_python, job)
    print(openvino_summary(out["device"], props))
    name = openvino_name(ns.openvino, props)
    prompt_tokens = sum(r.prompt_len for r in requests)
    return ThroughputResult(name, out["seconds"], out["num_requests"], prompt_tokens, out["output_tokens"])


def _spec_delta(before: dict, after: dict) -> dict:
    """The speculation counters of one run (the warm-up's subtracted)."""
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    d = {k: after[k] - before[k] for k in keys}
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 0.0
    return d


def print_results(results: list[ThroughputResult]) -> None:
    print(f"{'engine':<30}{'req/s':>8}{'output tok/s':>14}{'total tok/s':>13}{'seconds':>10}")
    for r in results:
        print(
            f"{r.name:<30}{r.requests_per_s:>8.2f}{r.output_tokens_per_s:>14.1f}{r.total_tokens_per_s:>13.1f}"
            f"{r.seconds:>10.1f}"
        )
    by_name = {r.name: r for r in results}
    for r in results:
        idle = by_name.get(r.name.split(" (load ")[0]) if " (load " in r.name else None
        if idle is not None:
            keep = r.output_tokens_per_s / idle.output_tokens_per_s
            print(
                f"retention {r.name}: {keep:.1%} of idle ({idle.output_tokens_per_s:.1f} -> "
                f"{r.output_tokens_per_s:.1f} output tok/s)"
            )
    for r in results[1:]:
        if r.name.startswith("kvserve (") and " (load " not in r.name:
            ratio = results[0].output_tokens_per_s / r.output_tokens_per_s
            print(f"kvserve / {r.name}: {ratio:.3f}x output tok/s ({(ratio - 1) * 100:+.1f}%)")
    hf = [r for r in results if r.name.startswith("hf-")]
    if hf:
        best = max(hf, key=lambda r: r.output_tokens_per_s)
        print(
            f"kvserve / best HF ({best.name}): {results[0].output_tokens_per_s / best.output_tokens_per_s:.2f}x "
            "output tok/s"
        )
    for r in results:
        if r.name.startswith("openvino-genai"):
            print(f"kvserve / {r.name}: {results[0].output_tokens_per_s / r.output_tokens_per_s:.2f}x output tok/s")


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput (kvserve, optionally vs HF transformers)")
    add_dataset_args(p, with_seed=False)
    p.add_argument(
        "--hf-batch-sizes",
        type=int,
        nargs="*",
        default=[],
        help="also run HF transformers generate with these static batch sizes",
    )
    p.add_argument(
        "--ablate",
        choices=["prefix-caching", "chunked-prefill", "speculative", "deterministic"],
        nargs="*",
        default=[],
        help="also run kvserve with this feature off, in the same run",
    )
    p.add_argument(
        "--competing-load",
        type=int,
        default=0,
        metavar="K",
        help="also time each run beside K busy processes (one CPU each) and print the retention vs idle",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of every request (0: greedy)")
    p.add_argument("--repeat", type=int, default=1, help="kvserve runs per configuration (ABBA order); median counts")
    p.add_argument("--json", default=None, help="write results to this file")
    add_openvino_args(p)
    p.add_argument("--openvino-cache-gb", type=int, default=2, help="OpenVINO's KV cache size (whole GB)")
    add_cli_args(p)
    p.set_defaults(func=main)
