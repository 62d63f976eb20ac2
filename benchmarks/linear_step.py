"""One decode step's linears of the embedded model (30 layers x SmolLM2-135M's four shapes + the LM head) through
one of kvserve's CPU linear paths, per row count: the median of 5 timings of two steps (ms). Random weights, each
layer its own copy (so they come from memory, as in a real step).

    PYTHONPATH=. python benchmarks/linear_step.py [--path bf16|int8|int4|fp32] [--rows 1 7 13 25 64]

An A/B of two kernel versions: run it alternately from two worktrees (each builds its own kernels, named by a hash
of their sources), several rounds, on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from benchmarks.linear_shapes import LAYERS, SHAPES
from kvserve.kernels.cpu import load_cpu_kernels
from kvserve.layers.quant.int4_linear import Int4Linear
from kvserve.layers.quant.int8_linear import Int8Linear

# (in, out) of one layer's linears, and the LM head's (linear_shapes.py's list, shared with bf16_shapes.py)
LAYER_SHAPES = [(k, n) for k, n in SHAPES if n < 10_000]
HEAD_IN, VOCAB = next((k, n) for k, n in SHAPES if n >= 10_000)


def make_linear(kernels, path: str, n: int, k: int):
    if path == "int8":
        return Int8Linear.from_float(torch.randn(n, k) * 0.05)
    if path == "int4":
        return Int4Linear.from_float(torch.randn(n, k) * 0.05)
    if path == "bf16":
        w = kernels.pack_linear_weight_bf16_pairs(torch.randn(n, k).bfloat16())
        return lambda x: kernels.linear_bf16_pairs(x, w, n, None)
    w = kernels.pack_linear_weight(torch.randn(n, k))
    return lambda x: kernels.linear_packed(x, w, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", choices=["bf16", "int8", "int4", "fp32"], default="bf16")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 7, 13, 25, 64])
    ns = ap.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels did not load")
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    layers = [[make_linear(kernels, ns.path, n, k) for k, n in LAYER_SHAPES] for _ in range(LAYERS)]
    head = make_linear(kernels, ns.path, VOCAB, HEAD_IN)
    dtype = torch.float32 if ns.path == "fp32" else torch.bfloat16

    def step(xs: dict[int, torch.Tensor]) -> None:
        for layer in layers:
            for (k, _), linear in zip(LAYER_SHAPES, layer, strict=True):
                linear(xs[k])
        head(xs[HEAD_IN])

    cells = []
    for m in ns.rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in {k for k, _ in SHAPES}}
        step(xs)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            step(xs)
            step(xs)
            times.append((time.perf_counter() - t) / 2 * 1e3)
        cells.append(f"{m}:{statistics.median(times):.2f}")
    print(f"{ns.path} step linears, ms by rows: " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
