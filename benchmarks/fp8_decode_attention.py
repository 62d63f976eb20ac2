"""Decode attention, kernel only, at batch 16 with 4096-token contexts: the bf16 cache (the pair-packed kernel where
the CPU has AVX512-BF16) against the fp8 caches, standard and pair-packed (where the CPU has AVX512-VBMI too)
(SmolLM2-135M's shape: 9 heads, 3 kv heads, head_dim 64, block 16;
4 layers with their own caches, blocks scattered over the pool). Prints ms per layer call.

    PYTHONPATH=. .venv/bin/python benchmarks/fp8_decode_attention.py [--adjacent]

--adjacent: each sequence's blocks in order, side by side in the pool (as after a fresh prefill), instead of
scattered.
"""

import sys
import time

import numpy as np
import torch

from kvserve.attention.cpu_kernels import pack_kv_blocks
from kvserve.attention.kv_dtype import quantize_kv
from kvserve.kernels.cpu import load_cpu_kernels

S, H, HKV, D, B, CTX, LAYERS = 16, 9, 3, 64, 16, 4096, 4


def main() -> None:
    kernels = load_cpu_kernels()
    rng = np.random.default_rng(0)
    blocks_per_seq = CTX // B
    num_blocks = S * blocks_per_seq
    order = np.arange(num_blocks) if "--adjacent" in sys.argv else rng.permutation(num_blocks)
    table = torch.from_numpy(order.astype(np.int32).reshape(S, blocks_per_seq))
    lens = torch.full((S,), CTX, dtype=torch.int64)
    q = torch.randn(S, H, D).bfloat16()
    base = [(torch.randn(num_blocks, B, HKV, D), torch.randn(num_blocks, B, HKV, D)) for _ in range(LAYERS)]
    caches = {}
    packed = kernels.packed_kv_supported(D, H // HKV, B)
    caches["bf16" + (" (pair-packed)" if packed else "")] = [
        pack_kv_blocks(k.bfloat16(), v.bfloat16()) if packed else (k.bfloat16(), v.bfloat16()) for k, v in base
    ]
    fp8_packed = kernels.packed_kv_supported(D, H // HKV, B, True)
    for name, dt in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        caches[name] = [(quantize_kv(k, dt), quantize_kv(v, dt)) for k, v in base]
        if fp8_packed:
            caches[name + " (pair-packed)"] = [pack_kv_blocks(k, v) for k, v in caches[name]]
    for name, layers in caches.items():
        attend = kernels.paged_attention_packed if name.endswith("(pair-packed)") else kernels.paged_attention_decode
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for k, v in layers:
                attend(q, k, v, table, lens, D**-0.5, 0)
            times.append((time.perf_counter() - start) / LAYERS * 1e3)
        print(f"{name:20s} {min(times):6.2f} ms per layer (min of 5; all: {', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
