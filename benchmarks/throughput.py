"""Offline throughput: kvserve vs HF transformers `generate` on the same model, workload and dtype, in one run.

Workload (vLLM's "random" dataset): N requests with random token prompts of IN_MIN..IN_MAX tokens and outputs of
OUT_MIN..OUT_MAX tokens, ignore_eos, fixed seed. HF runs static batches (left-padded; each batch decodes until its
longest request is done, and only each request's own tokens count). Also measures batch-1 decode ms/token.

    python benchmarks/throughput.py                      # embedded SmolLM2-135M-Instruct, bf16
    python benchmarks/throughput.py --hf-batch-sizes 8 16 32 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def random_workload(n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    # Ids from the middle of the vocabulary: regular tokens, no special ones.
    prompts = [[rng.randrange(1000, vocab - 1000) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*out_range) for _ in range(n)])


@dataclass
class Result:
    name: str
    seconds: float
    num_requests: int
    output_tokens: int
    total_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return self.total_tokens / self.seconds

    @property
    def req_s(self) -> float:
        return self.num_requests / self.seconds


def run_kvserve(llm, wl: Workload) -> Result:
    from kvserve import SamplingParams

    params = [
        SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(wl.output_lens)
    ]
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == wl.num_output_tokens, (produced, wl.num_output_tokens)
    return Result("kvserve", elapsed, len(outs), produced, produced + wl.num_prompt_tokens)


def kvserve_batch1_decode_ms(llm, prompt: list[int], n: int = 128) -> float:
    from kvserve import SamplingParams

    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
    )[0]
    m = out.metrics
    return (m.last_token_time - m.first_token_time) / (n - 1) * 1000


def run_hf(model, wl: Workload, batch_size: int, pad_id: int) -> Result:
    start = time.perf_counter()
    order = sorted(range(len(wl.prompts)), key=lambda i: len(wl.prompts[i]))  # less padding: a fair baseline
    produced = 0
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(wl.prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = wl.prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(wl.output_lens[i] for i in idx)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                pad_token_id=pad_id,
            )
        produced += sum(wl.output_lens[i] for i in idx)  # only each request's own tokens count
    elapsed = time.perf_counter() - start
    return Result(f"hf-generate-bs{batch_size}", elapsed, len(wl.prompts), produced, produced + wl.num_prompt_tokens)


def hf_batch1_decode_ms(model, prompt: list[int], n: int = 128) -> float:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (n - 1) * 1000


def load_hf(model_path: str, dtype: torch.dtype):
    import transformers

    if model_path.endswith(".gguf"):
        # Dense weights, like kvserve's: transformers would otherwise keep GGUF blocks and run its own fp32 kernels.
        d, f = os.path.split(model_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, dtype=dtype, quantization_config=transformers.GgufConfig(dequantize=True)
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[32], help="none to skip HF")
    ap.add_argument("--skip-batch1", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    from kvserve import LLM
    from kvserve.loader.default_model import resolve_model_path

    model_path = resolve_model_path(args.model)
    torch_dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    llm = LLM(
        args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    print(f"kvserve loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    vocab = llm.engine.config.model.arch.vocab_size
    wl = random_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab, args.seed)
    print(
        f"workload: {args.num_requests} requests, {wl.num_prompt_tokens} prompt + {wl.num_output_tokens} output tokens",
        file=sys.stderr,
    )

    # Warm-up (first-touch of KV pages, allocator, oneDNN kernels), not timed.
    run_kvserve(llm, random_workload(8, (64, 128), (8, 16), vocab, args.seed + 1))
    results = [run_kvserve(llm, wl)]
    print(f"kvserve: {results[0].output_tok_s:.1f} output tok/s", file=sys.stderr)
    b1_prompt = wl.prompts[0][:32]
    batch1 = {}
    if not args.skip_batch1:
        batch1["kvserve"] = kvserve_batch1_decode_ms(llm, b1_prompt)
    stats = llm.stats()
    del llm

    if args.hf_batch_sizes:
        hf = load_hf(
            model_path if model_path.endswith(".gguf") or os.path.isdir(model_path) else args.model, torch_dtype
        )
        pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
        for bs in args.hf_batch_sizes:
            r = run_hf(hf, wl, bs, pad_id)
            print(f"{r.name}: {r.output_tok_s:.1f} output tok/s", file=sys.stderr)
            results.append(r)
        if not args.skip_batch1:
            batch1["hf-generate"] = hf_batch1_decode_ms(hf, b1_prompt)

    best_hf = max((r for r in results if r.name.startswith("hf")), key=lambda r: r.output_tok_s, default=None)
    print(
        f"\nmodel={os.path.basename(model_path)} dtype={args.dtype} torch threads={torch.get_num_threads()} "
        f"cpu={platform.processor() or platform.machine()}"
    )
    print(f"{'engine':<22}{'req/s':>8}{'output tok/s':>14}{'total tok/s':>13}{'seconds':>10}")
    for r in results:
        print(f"{r.name:<22}{r.req_s:>8.2f}{r.output_tok_s:>14.1f}{r.total_tok_s:>13.1f}{r.seconds:>10.1f}")
    if best_hf is not None:
        print(f"kvserve / best HF ({best_hf.name}) output tok/s: {results[0].output_tok_s / best_hf.output_tok_s:.2f}x")
    for name, ms in batch1.items():
        print(f"batch-1 decode {name}: {ms:.1f} ms/token ({1000 / ms:.1f} tok/s)")
    if "kvserve" in batch1 and "hf-generate" in batch1:
        print(f"batch-1 decode speedup kvserve vs HF: {batch1['hf-generate'] / batch1['kvserve']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "results": [
                        {**asdict(r), "output_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s} for r in results
                    ],
                    "batch1_decode_ms": batch1,
                    "kvserve_stats": stats,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
