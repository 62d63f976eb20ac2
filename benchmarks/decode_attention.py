"""Batch-64 decode attention as a decode step sees it, kernel only: 64 sequences of 128-192 tokens, 30 layers with
their own caches, blocks scattered over the pool (SmolLM2-135M's shape: 9 heads, 3 kv heads, head_dim 64, block 16).

    KVSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/decode_attention.py [other_build.so ...]

Times this checkout's kernels and, interleaved in the same run, any other builds of them given as `.so` paths
(e.g. from ~/.cache/torch_extensions), after checking that they agree. Each build runs in a process of its own
(pybind11 refuses a second build's classes in one process), on the same seeded data.
"""

import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.kernels.cpu import load_cpu_kernels

S, H, HKV, D, B, L = 64, 9, 3, 64, 16, 30
THIS = "this checkout"


def draw_lens(rng: np.random.Generator) -> np.ndarray:
    """The 64 context lengths: the first draw of the seeded generator, in the parent and in every child."""
    return rng.integers(128, 193, S)


def load(build: str):
    if build == THIS:
        return load_cpu_kernels()
    spec = importlib.util.spec_from_file_location(Path(build).stem, build)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_one(build: str, out_path: str) -> None:
    """One build: its first layer's output into out_path, then ms per step (30 layers, mean of 3) on stdout."""
    module = load(build)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    lens = draw_lens(rng)
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
    torch.save(module.paged_attention_decode(q, caches[0][0], caches[0][1], table_t, lens_t, 0.125), out_path)
    start = time.perf_counter()
    for _ in range(3):
        for kc, vc in caches:
            module.paged_attention_decode(q, kc, vc, table_t, lens_t, 0.125)
    print((time.perf_counter() - start) / 3 * 1e3)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        run_one(sys.argv[2], sys.argv[3])
        return
    builds = [THIS, *sys.argv[1:]]
    kv_bytes = L * int(draw_lens(np.random.default_rng(0)).sum()) * HKV * D * 4 * 2
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(5):
            for n, build in enumerate(builds):
                out = f"{tmp}/{n}.pt"
                cmd = [sys.executable, __file__, "--one", build, out]
                ms = float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1])
                if r == 0 and n > 0:
                    torch.testing.assert_close(torch.load(out), torch.load(f"{tmp}/0.pt"))
                print(f"{build}: {ms:.1f} ms per step (30 layers), {kv_bytes / ms / 1e6:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
