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

from kvserve.benchmarks.roofline import decode_throughput
from kvserve.benchmarks.throughput import platform_line
from kvserve.engine.arg_utils import EngineArgs, add_cli_args
from kvserve.platform import platform_record


def prefill_seconds(llm, prompt_len: int, seed: int) -> float:
    from kvserve.sampling_params import SamplingParams

    engine = llm.engine
    vocab = engine.config.model.arch.vocab_size
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, vocab - 1000) for _ in range(prompt_len)]
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
    model_config = llm.engine.config.model
    print(platform_line(model_config.dtype))
    print(f"weights: {model_config.quantization or model_config.dtype}")
    prefill_seconds(llm, 64, seed=-1)  # warm-up
    decode_throughput(llm, 1, 1, 8, seed=-1)
    pp = [ns.prompt_len / prefill_seconds(llm, ns.prompt_len, seed=i) for i in range(ns.repeat)]
    tg = [decode_throughput(llm, 1, 1, ns.gen_len, seed=i).tokens_per_s for i in range(ns.repeat)]
    for name, values, n in (("pp", pp, ns.prompt_len), ("tg", tg, ns.gen_len)):
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{name}{n}: {statistics.mean(values):.1f} ± {spread:.1f} tok/s")
    if ns.json:
        with open(ns.json, "w") as f:
            record = platform_record(model_config.dtype, __import__("torch").get_num_threads())
            json.dump({"platform": record, "quantization": model_config.quantization, "pp": pp, "tg": tg}, f)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="one request at a time: prefill and batch-1 decode tok/s (llama-bench's)")
    add_cli_args(p)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)
