"""`kvserve bench perplexity`: quality of each weight mode on local English text, in one run.

Text: docstrings of the Python standard library's top-level modules (module, class and function docstrings, in
file order), which ship with every Python; the same Python version gives the same text. Each mode (`dtype` or
`dtype:quantization`, e.g. float32, bfloat16, float32:int8, optionally with the KV cache's format after a slash,
e.g. bfloat16/fp8_e4m3) loads the engine once and scores the same non-overlapping windows of --window tokens;
perplexity = exp(mean negative log-likelihood of every token after the first of each window). On a quantized GGUF,
float32 is the GGUF's own quantization decoded exactly.

Greedy agreement: for --num-prompts prompts (openings of docstrings not scored), the number of leading greedy
tokens (of --agree-len) each mode shares with the first mode's output.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import sysconfig

import numpy as np

from kvserve.benchmarks.throughput import platform_line
from kvserve.engine.arg_utils import EngineArgs, add_cli_args


def stdlib_docstrings(min_chars: int = 200) -> list[str]:
    """Docstrings of at least `min_chars` from the standard library's top-level modules, in a fixed order."""
    from kvserve.spec_decode.local_text import docstrings

    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            texts.extend(docstrings(os.path.join(root, name), min_chars))
    return texts


def window_nll(llm, token_ids: list[int]) -> tuple[float, int]:
    """Sum of -log p(token | preceding tokens of the window) over the window's tokens after the first, computed
    with the engine's own model, attention backend and KV cache (as one prefill, while no request runs)."""
    import torch

    from kvserve.attention.base import AttentionInputs

    runner = llm.engine.engine_core.executor.driver_runner
    n = len(token_ids)
    num_blocks = -(-n // runner.block_size)
    if num_blocks > runner.num_blocks:
        raise ValueError(f"a window of {n} tokens needs {num_blocks} KV blocks; the cache has {runner.num_blocks}")
    inputs = AttentionInputs(
        num_decodes=0,
        query_start_loc=np.array([0, n], dtype=np.int64),
        seq_lens=np.array([n], dtype=np.int64),
        block_table=np.arange(num_blocks, dtype=np.int32)[None, :],
        slot_mapping=np.arange(n, dtype=np.int64),
        block_size=runner.block_size,
    )
    with torch.inference_mode():
        ids = torch.tensor(token_ids, dtype=torch.long)
        hidden = runner.model(ids, torch.arange(n), runner.kv_caches, runner.attn_backend.build_metadata(inputs))
        logprobs = torch.log_softmax(runner.model.compute_logits(hidden[:-1]), dim=-1)
        nll = -logprobs.gather(1, ids[1:, None]).sum().item()
    return nll, n - 1


def greedy_outputs(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(ns: argparse.Namespace) -> int:
    from kvserve.engine.llm import LLM

    docs = stdlib_docstrings()
    # The last num_prompts docstrings give the greedy prompts, the others the scored text (docs[-0:] would be all).
    split = len(docs) - ns.num_prompts
    prompts = [" ".join(d.split()[:12]) for d in docs[split:]]
    results = []
    reference_outputs = None
    for mode in ns.modes:
        weights, _, kv_cache_dtype = mode.partition("/")
        dtype, _, quant = weights.partition(":")
        args = EngineArgs.from_cli_args(ns)
        args.dtype, args.quantization = dtype, quant or "none"
        args.kv_cache_dtype = kv_cache_dtype or "auto"
        args.max_model_len = max(ns.window, 256)
        llm = LLM.from_engine_args(args)
        if not results:
            print(platform_line(llm.engine.config.model.dtype))
            print(f"text: {len(docs)} docstrings of the Python {sys.version.split()[0]} standard library")
        tok = llm.get_tokenizer()
        ids = tok.encode("\n\n".join(docs[:split]))
        windows = [ids[i : i + ns.window] for i in range(0, ns.num_windows * ns.window, ns.window)]
        windows = [w for w in windows if len(w) >= 2]  # past the text's end: nothing to score
        if len(windows) < ns.num_windows:
            print(f"the text holds {len(windows)} windows of up to {ns.window} tokens, not {ns.num_windows}")
        total, count = 0.0, 0
        for w in windows:
            nll, n = window_nll(llm, w)
            total, count = total + nll, count + n
        outputs = greedy_outputs(llm, prompts, ns.agree_len)
        if reference_outputs is None:
            reference_outputs = outputs
        agree = [common_prefix(a, b) for a, b in zip(reference_outputs, outputs, strict=True)]
        runner = llm.engine.engine_core.executor.driver_runner
        row = {
            "mode": mode,
            "perplexity": math.exp(total / count),
            "tokens": count,
            "weight_mib": runner.weight_bytes / 2**20,
            "greedy_agreement": agree,
        }
        results.append(row)
        full = sum(a == ns.agree_len for a in agree)
        print(
            f"{mode:<16} perplexity {row['perplexity']:.3f} over {count} tokens; weights {row['weight_mib']:.0f} MiB; "
            f"greedy vs {ns.modes[0]}: {full}/{len(agree)} prompts identical over {ns.agree_len} tokens, "
            f"mean common prefix {sum(agree) / max(1, len(agree)):.1f}"
        )
        del llm
        gc.collect()
    base = results[0]["perplexity"]
    for r in results[1:]:
        print(f"{r['mode']}: perplexity {r['perplexity'] / base - 1:+.2%} vs {results[0]['mode']}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity and greedy agreement of weight modes on local text")
    add_cli_args(p)
    p.add_argument(
        "--modes",
        nargs="+",
        default=["float32", "float32:int8"],
        help="dtype, dtype:quantization, either with /kv_cache_dtype (e.g. bfloat16/fp8_e4m3) per mode; the first is "
        "the reference for greedy agreement",
    )
    p.add_argument("--window", type=int, default=512, help="tokens per scored window")
    p.add_argument("--num-windows", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=16, help="prompts for greedy agreement")
    p.add_argument("--agree-len", type=int, default=64)
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)
