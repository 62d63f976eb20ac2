"""`kvserve bench latency`: one request at a time, the two figures llama.cpp's `llama-bench` reports.

- pp: prompt processing, a random prompt of --prompt-len tokens prefilled in one step (llama-bench pp512);
- tg: batch-1 decode, --gen-len tokens one step each after a one-token prompt (llama-bench tg128).
Each is repeated (--repeat, fresh random prompts so the prefix cache never hits) and reported as mean and spread.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvserve.benchmarks.openvino_peer import (
    add_openvino_args,
    engine_threads,
    openvino_name,
    openvino_properties,
    openvino_summary,
    run_openvino,
)
from kvserve.benchmarks.roofline import decode_throughput
from kvserve.benchmarks.throughput import platform_line
from kvserve.engine.arg_utils import EngineArgs, add_cli_args
from kvserve.platform import platform_record


def random_prompt(vocab_size: int, prompt_len: int, seed: int) -> list[int]:
    """The prompt `prefill_seconds` and `decode_throughput` (its first request) draw for this seed."""
    rng = random.Random(seed)
    return [rng.randrange(1000, vocab_size - 1000) for _ in range(prompt_len)]


def prefill_seconds(llm, prompt_len: int, seed: int) -> float:
    from kvserve.sampling_params import SamplingParams

    engine = llm.engine
    vocab = engine.config.model.arch.vocab_size
    prompt = random_prompt(vocab, prompt_len, seed)
    engine.add_request(f"pp-{seed}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main(ns: argparse.Namespace) -> int:
    from kvserve.engine.llm import LLM

    args = EngineArgs.from_cli_args(ns)
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = max(2048, ns.prompt_len)  # the prompt in one step, as llama-bench does
    llm = LLM.from_engine_args(args)
    llm.engine.engine_core.executor.collective_rpc("prefault_kv_cache")
    engine_config = llm.engine.config
    model_config = engine_config.model
    print(platform_line(model_config.dtype))
    print(f"weights: {model_config.quantization or model_config.dtype}")
    prefill_seconds(llm, 64, seed=-1)  # warm-up
    decode_throughput(llm, 1, 1, 8, seed=-1)
    pp = [ns.prompt_len / prefill_seconds(llm, ns.prompt_len, seed=i) for i in range(ns.repeat)]
    tg = [decode_throughput(llm, 1, ns.tg_prompt_len, ns.gen_len, seed=i).tokens_per_s for i in range(ns.repeat)]
    print_figures("kvserve", pp, tg, ns)
    threads = __import__("torch").get_num_threads()
    record = {"platform": platform_record(model_config.dtype, threads)}
    record.update(quantization=model_config.quantization, pp=pp, tg=tg)
    if ns.openvino:
        del llm  # the peer runs alone on the cores
        ov = run_openvino_latency(ns, model_config, engine_threads(engine_config))
        print_figures(ov["name"], ov["pp"], ov["tg"], ns)
        for key, values in (("pp", pp), ("tg", tg)):
            print(f"kvserve / {ov['name']} {key}: {statistics.mean(values) / statistics.mean(ov[key]):.2f}x")
        record["openvino"] = ov
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(record, f)
    return 0


def print_figures(name: str, pp: list[float], tg: list[float], ns: argparse.Namespace) -> None:
    for key, values, n in (("pp", pp, ns.prompt_len), ("tg", tg, ns.gen_len)):
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{name} {key}{n}: {statistics.mean(values):.1f} ± {spread:.1f} tok/s")


def run_openvino_latency(ns: argparse.Namespace, model_config, threads: int) -> dict:
    """The same measures through OpenVINO GenAI's LLMPipeline, on the same random prompts: pp from its time to first
    token on a --prompt-len prompt, tg from its time per output token over --gen-len tokens after a
    --tg-prompt-len prompt; one untimed run of each first."""
    props = openvino_properties(ns.openvino_precision, model_config.dtype, threads, ns.openvino_property)
    vocab = model_config.arch.vocab_size

    def prompts(n: int) -> list[list[int]]:
        return [random_prompt(vocab, n, seed) for seed in range(-1, ns.repeat)]

    job = {"mode": "latency", "model_dir": ns.openvino, "properties": props, "temperature": 1.0, "seed": 0}
    job.update(gen_len=ns.gen_len, pp_prompts=prompts(ns.prompt_len), tg_prompts=prompts(ns.tg_prompt_len))
    out = run_openvino(ns.openvino_python, job)
    print(openvino_summary(out["device"], props))
    return {"name": openvino_name(ns.openvino, props), **out}


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="one request at a time: prefill and batch-1 decode tok/s (llama-bench's)")
    add_cli_args(p)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--tg-prompt-len", type=int, default=1, help="prompt length before the tg decode (llama-bench: 1)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    add_openvino_args(p)
    p.set_defaults(func=main)
