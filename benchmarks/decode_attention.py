"""Batch-64 decode attention as a decode step sees it, kernel only: 64 sequences of 128-192 tokens, 30 layers with
their own caches, blocks scattered over the pool (SmolLM2-135M's shape: 9 heads, 3 kv heads, head_dim 64, block 16).

    KVSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/decode_attention.py [other_build.so ...]

Times this checkout's kernels and, interleaved in the same run, any other builds of them given as `.so` paths
(e.g. from ~/.cache/torch_extensions), after checking that they agree.
"""

import importlib.util
import sys
import time

import numpy as np
import torch

from kvserve.kernels.cpu import load_cpu_kernels

S, H, HKV, D, B, L = 64, 9, 3, 64, 16, 30


def main() -> None:
    builds = {"this checkout": load_cpu_kernels()}
    for path in sys.argv[1:]:
        spec = importlib.util.spec_from_file_location(path.rsplit("/", 1)[-1][:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        builds[path] = module
    rng = np.random.default_rng(0)
    lens = rng.integers(128, 193, S)
    nb = (lens + B - 1) // B
    pool = int(nb.sum() * 1.3)
    caches = [(torch.randn(pool, B, HKV, D), torch.randn(pool, B, HKV, D)) for _ in range(L)]
    perm = rng.permutation(pool)[: nb.sum()].astype(np.int32)
    table = np.zeros((S, nb.max()), np.int32)
    offset = 0
    for i in range(S):
        table[i, : nb[i]] = perm[offset : offset + nb[i]]
        offset += nb[i]
    table_t, lens_t = torch.from_numpy(table), torch.from_numpy(lens.astype(np.int64))
    q = torch.randn(S, H, D)
    ref = None
    for module in builds.values():
        out = module.paged_attention_decode(q, caches[0][0], caches[0][1], table_t, lens_t, 0.125)
        if ref is None:
            ref = out
        else:
            torch.testing.assert_close(out, ref)
    kv_bytes = L * int(lens.sum()) * HKV * D * 4 * 2
    for _ in range(5):
        for name, module in builds.items():
            start = time.perf_counter()
            for _ in range(3):
                for kc, vc in caches:
                    module.paged_attention_decode(q, kc, vc, table_t, lens_t, 0.125)
            ms = (time.perf_counter() - start) / 3 * 1e3
            print(f"{name}: {ms:.1f} ms per step (30 layers), {kv_bytes / ms / 1e6:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
