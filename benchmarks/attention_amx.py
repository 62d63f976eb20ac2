"""Pair-packed bf16 attention on AMX tiles vs the AVX512-BF16 vectors, one layer call at a time, both paths in one
run (A/B alternated; `attention_amx_set_enabled` switches the kernel between calls). The caches are far larger than
L2 and spread over `--layers` layers' pools with scattered blocks, as a model's decode reads them.

    PYTHONPATH=. python benchmarks/attention_amx.py            # SmolLM2-135M's heads (9 / 3, 64 dims)
    PYTHONPATH=. python benchmarks/attention_amx.py --llama3   # Llama-3-8B's (32 / 8, 128 dims)

Cells: decode (one row per request) and a prefill chunk (consecutive rows of one request, which the tile path
groups 16 tokens to a tile). ms per layer call, best of 3 passes over the layers.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.kernels.cpu import load_cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama3", action="store_true")
    args = ap.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.attention_amx_active():
        raise SystemExit("no AMX attention here (no AMX-BF16, no C++ kernels, or KVSERVE_CPU_AMX set)")
    torch.manual_seed(0)
    if args.llama3:
        heads, kv_heads, hd, layers, blocks_per_seq = 32, 8, 128, 8, 64
        decode = (16, 700, 1000)  # requests, context range
        chunk = (256, 700)  # prefill rows after this many cached
    else:
        heads, kv_heads, hd, layers, blocks_per_seq = 9, 3, 64, 30, 40
        decode = (64, 230, 330)
        chunk = (128, 200)
    bs = 16
    num_blocks = decode[0] * blocks_per_seq
    shape = (num_blocks, bs, kv_heads, hd)
    pools = [(torch.randn(shape).to(torch.bfloat16), torch.randn(shape).to(torch.bfloat16)) for _ in range(layers)]
    perm = torch.randperm(num_blocks).int()
    n, lo, hi = decode
    dec = (
        torch.randn(n, heads, hd).to(torch.bfloat16),
        perm.view(n, blocks_per_seq).contiguous(),
        torch.randint(lo, hi, (n,), dtype=torch.int64),
    )
    rows, cached = chunk
    pre = (
        torch.randn(rows, heads, hd).to(torch.bfloat16),
        perm[:blocks_per_seq].repeat(rows, 1).contiguous(),
        torch.arange(cached + 1, cached + rows + 1, dtype=torch.int64),
    )

    def ms(q, table, lens) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for k, v in pools:
                kernels.paged_attention_packed(q, k, v, table, lens, hd**-0.5)
            best = min(best, time.perf_counter() - start)
        return best / layers * 1e3

    print(f"heads {heads}/{kv_heads}, head_dim {hd}: ms per layer call")
    for on in (False, True, False, True):
        kernels.attention_amx_set_enabled(on)
        print(
            f"  {'tiles  ' if on else 'vectors'} decode {n} x {lo}-{hi} keys: {ms(*dec):.3f}"
            f"   prefill {rows} rows after {cached}: {ms(*pre):.3f}"
        )


if __name__ == "__main__":
    main()
