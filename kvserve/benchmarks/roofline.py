"""`kvserve bench roofline`: kvserve's decode speed against this machine's limits, measured in the same run.

- compute roofline (large batch): bf16 matmul FLOP/s / (2 x parameters) tokens/s;
- memory roofline (batch 1): weight bytes / memory bandwidth per token.
Decode throughput is measured in steady state: every request has finished its prefill and each step adds one
token to each of them. `--profile` also reports where a step's time goes (scheduler, input preparation, model
forward, logits, sampling, output processing) over a mixed workload.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from kvserve.benchmarks.throughput import platform_line
from kvserve.engine.arg_utils import EngineArgs, add_cli_args
from kvserve.platform import platform_record


@dataclass
class MachineLimits:
    matmul_gflops: float  # bf16 (or the model dtype) GEMM
    bandwidth_gbs: float  # torch copy, read + write counted


def measure_machine(dtype: torch.dtype = torch.bfloat16) -> MachineLimits:
    n = 2048
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    gflops = 2 * n**3 / best / 1e9
    src = torch.empty(128 << 20, dtype=torch.float32)  # 512 MiB, far beyond the caches
    src.fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    bandwidth = 2 * src.numel() * 4 / best / 1e9
    return MachineLimits(gflops, bandwidth)


def count_parameters(arch) -> int:
    """Parameters as the checkpoint counts them (a tied LM head once). Counted from the architecture because the
    runner's prepacked linears keep their weights outside `nn.Module.parameters()`."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if arch.attention_bias else 0) + (2 * d if arch.qk_norm else 0)
    mlp = 3 * h * arch.intermediate_size
    layer = attn + mlp + 2 * h
    embed = arch.vocab_size * h
    head = 0 if arch.tie_word_embeddings else arch.vocab_size * h
    return arch.num_hidden_layers * layer + embed + head + h


@dataclass
class DecodePoint:
    batch_size: int
    prompt_len: int
    decode_steps: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size * self.decode_steps / self.seconds

    @property
    def ms_per_step(self) -> float:
        return self.seconds / self.decode_steps * 1000


def decode_throughput(llm, batch_size: int, prompt_len: int, steps: int, seed: int = 0) -> DecodePoint:
    """Steady-state decode: prefill `batch_size` random prompts, then time `steps` steps of one token each."""
    import random

    from kvserve.sampling_params import SamplingParams

    engine = llm.engine
    core = engine.engine_core
    vocab = engine.config.model.arch.vocab_size
    rng = random.Random(seed)
    for i in range(batch_size):
        prompt = [rng.randrange(1000, vocab - 1000) for _ in range(prompt_len)]
        params = SamplingParams(temperature=1.0, max_tokens=steps + 1, ignore_eos=True, seed=i)
        engine.add_request(f"decode-{batch_size}-{i}", {"prompt_token_ids": prompt}, params)
    sched = core.scheduler
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        engine.step()
    assert len(sched.running) == batch_size, "the batch does not fit: raise max_num_seqs or the KV cache"
    start = time.perf_counter()
    n = 0
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    seconds = time.perf_counter() - start
    return DecodePoint(batch_size, prompt_len, n, seconds)


def profile_split(llm, num_requests: int = 64, seed: int = 0) -> dict[str, float]:
    """Fractions of wall time per phase over a mixed prefill/decode workload (random dataset)."""
    from kvserve.benchmarks.datasets import DatasetSpec, build_dataset
    from kvserve.benchmarks.throughput import run_kvserve

    core = llm.engine.engine_core
    vocab = llm.engine.config.model.arch.vocab_size
    requests = build_dataset(DatasetSpec("random", num_requests, seed, (64, 512), (64, 256)), vocab)
    core.timer.reset()
    core.timer.enabled = True
    with _op_timers() as ops:
        start = time.perf_counter()
        run_kvserve(llm, requests, "profile")
        total = time.perf_counter() - start
    core.timer.enabled = False
    split = {k: v / total for k, v in core.timer.seconds.items()}
    split["frontend+other"] = 1.0 - sum(split.values())
    split["steps"] = core.timer.steps
    split["seconds"] = total
    # Inside forward + logits: the layers' share of the whole run (attention includes the KV-cache writes).
    inner = {f"  {k}": v / total for k, v in ops.items()}
    inner["  other ops"] = split.get("forward", 0.0) + split.get("logits", 0.0) - sum(inner.values())
    split.update(inner)
    return split


@contextmanager
def _op_timers():
    """Wall time per layer kind, by wrapping the modules' entry points (CPU ops are synchronous, so the time a
    call takes is the time its kernels take). Costs ~1 us per call: negligible next to the ops themselves."""
    from kvserve.attention.cpu_kernels import CpuKernelAttentionBackend
    from kvserve.attention.torch_ref import TorchRefAttentionBackend
    from kvserve.layers.activation import SiluAndMul
    from kvserve.layers.linear import Linear
    from kvserve.layers.norm import RMSNorm
    from kvserve.layers.quant.int4_linear import Int4Linear
    from kvserve.layers.quant.int8_linear import Int8Linear
    from kvserve.layers.rotary import RotaryEmbedding

    totals: dict[str, float] = defaultdict(float)
    patched = [
        (Linear, "forward", "linear"),
        (Int8Linear, "forward", "linear"),
        (Int4Linear, "forward", "linear"),
        (CpuKernelAttentionBackend, "forward", "attention"),
        (TorchRefAttentionBackend, "forward", "attention"),
        (RMSNorm, "forward", "rmsnorm"),
        (RotaryEmbedding, "rotate_", "rotary"),
        (SiluAndMul, "forward", "silu_and_mul"),
    ]
    from kvserve.models.llama import LlamaDecoderLayer

    # The fused C++ layer would hide the ops inside one call: time them through the module path.
    fused = LlamaDecoderLayer.use_fused
    LlamaDecoderLayer.use_fused = False
    originals = []
    for owner, attr, name in patched:
        original = getattr(owner, attr)
        originals.append((owner, attr, original))

        def timed(*args, _original=original, _name=name, **kwargs):
            t = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - t

        setattr(owner, attr, timed)
    try:
        yield totals
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)
        LlamaDecoderLayer.use_fused = fused


def main(ns: argparse.Namespace) -> int:
    from kvserve.engine.llm import LLM

    args = EngineArgs.from_cli_args(ns)
    llm = LLM.from_engine_args(args)
    llm.engine.engine_core.executor.collective_rpc("prefault_kv_cache")  # as in `bench throughput`: time steady state
    print(platform_line(llm.engine.config.model.dtype))
    dtype = getattr(torch, llm.engine.config.model.dtype)
    num_params = count_parameters(llm.engine.config.model.arch)
    weight_bytes = num_params * torch.empty((), dtype=dtype).element_size()
    decode_throughput(llm, 4, 32, 8)  # warm-up
    print(f"model: {num_params / 1e6:.1f}M parameters, {weight_bytes / 1e6:.0f} MB of weights")
    # This VM's matmul and copy rates move by up to ~30% within minutes, and a fraction is only meaningful against
    # the limits of the same moment: each round measures the machine right before its decode points, and the
    # summary is the median of the rounds' fractions.
    rounds = []
    for r in range(ns.rounds):
        limits = measure_machine(dtype)
        compute_roof = limits.matmul_gflops * 1e9 / (2 * num_params)
        memory_roof_ms = weight_bytes / (limits.bandwidth_gbs * 1e9) * 1000
        print(
            f"round {r + 1}: machine {limits.matmul_gflops:.0f} GFLOP/s matmul ({llm.engine.config.model.dtype}), "
            f"{limits.bandwidth_gbs:.1f} GB/s memory; rooflines: compute {compute_roof:.0f} tok/s (large batch), "
            f"memory {memory_roof_ms:.1f} ms/token (batch 1)"
        )
        points = []
        for bs in ns.batch_sizes:
            pt = decode_throughput(llm, bs, ns.prompt_len, ns.decode_steps, seed=r)
            frac = memory_roof_ms / pt.ms_per_step if bs == 1 else pt.tokens_per_s / compute_roof
            points.append(
                {**asdict(pt), "tokens_per_s": pt.tokens_per_s, "ms_per_step": pt.ms_per_step, "fraction": frac}
            )
            if bs == 1:
                print(
                    f"  batch 1: {pt.ms_per_step:.1f} ms/token = {frac:.0%} of the memory roofline "
                    f"({1000 / pt.ms_per_step:.1f} tok/s)"
                )
            else:
                print(
                    f"  batch {bs}: {pt.tokens_per_s:.0f} tok/s ({pt.ms_per_step:.0f} ms/step) = "
                    f"{frac:.0%} of the compute roofline"
                )
        rounds.append(
            {
                "machine": asdict(limits),
                "compute_roofline_tok_s": compute_roof,
                "memory_roofline_ms": memory_roof_ms,
                "decode": points,
            }
        )
    medians = {}
    for i, bs in enumerate(ns.batch_sizes):
        medians[bs] = statistics.median(r["decode"][i]["fraction"] for r in rounds)
    if ns.rounds > 1:
        print(
            "median over rounds: "
            + ", ".join(
                f"batch {bs} {m:.0%} of the {'memory' if bs == 1 else 'compute'} roofline" for bs, m in medians.items()
            )
        )
    split = None
    if ns.profile:
        split = profile_split(llm)
        print(f"time split over a mixed workload ({split['steps']} steps, {split['seconds']:.1f} s):")
        for k, v in split.items():
            if k not in ("steps", "seconds"):
                print(f"  {k:<16}{v:7.1%}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(
                {
                    "platform": platform_record(llm.engine.config.model.dtype, torch.get_num_threads()),
                    "num_params": num_params,
                    "rounds": rounds,
                    "median_fraction": {str(bs): m for bs, m in medians.items()},
                    "profile_split": split,
                },
                f,
                indent=2,
            )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("roofline", help="decode throughput vs the machine's compute and memory rooflines")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 128, 256])
    p.add_argument("--prompt-len", type=int, default=128, help="context at the start of the timed decode")
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="repeat machine limits + decode points; report the median")
    p.add_argument("--profile", action="store_true", help="also report the time split per step phase")
    p.add_argument("--json", default=None)
    add_cli_args(p)
    p.set_defaults(func=main)
