"""Per-shape timing of the linear-layer paths on this CPU: F.linear on the plain weight, oneDNN's prepacked GEMM
and kvserve's panel kernel, at several row counts, for SmolLM2-135M's weight shapes (fp32).

Each shape gets 30 distinct weight copies used in turn (as 30 layers would be), so the weights come from memory
rather than cache; the LM head gets one. Reports the best of 5 timings of 10 calls each, and per-step totals
(30 layers + LM head). Run: `KVSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/linear_shapes.py 1 64 256`.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import kvserve  # noqa: F401  (applies KVSERVE_CPU_ISA's caps to torch before it runs anything)
from kvserve.kernels.cpu import load_cpu_kernels
from kvserve.platform import cpu_info

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (in, out)
LAYERS = 30


def best_ms(fn, calls: int = 10, reps: int = 5) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e3)
    return best


def time_paths(kernels, x: torch.Tensor, plain: list, onednn: list, panels: list) -> dict[str, float]:
    """Best ms per call of each path, taking the weight copies in turn."""
    n, turn = plain[0].shape[0], iter(range(10**9))
    paths = {
        "plain": lambda: F.linear(x, plain[next(turn) % len(plain)]),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn[next(turn) % len(plain)], None, "none", [], ""),
        "panels": lambda: kernels.linear_packed(x, panels[next(turn) % len(plain)], n),
    }
    return {name: best_ms(fn) for name, fn in paths.items()}


def main(rows: list[int]) -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        sys.exit("the C++ kernels did not load")
    print(cpu_info().describe())
    torch.manual_seed(0)
    totals: dict[tuple[int, str], float] = {}
    for k, n in SHAPES:
        copies = 1 if n > 10_000 else LAYERS
        plain = [torch.randn(n, k) for _ in range(copies)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in plain]
        panels = [kernels.pack_linear_weight(w) for w in plain]
        for m in rows:
            times = time_paths(kernels, torch.randn(m, k), plain, onednn, panels)
            for name, ms in times.items():
                totals[(m, name)] = totals.get((m, name), 0.0) + ms * (LAYERS if copies > 1 else 1)
            gflop = 2 * m * k * n / 1e9
            cols = " ".join(f"{name}={ms:.3f}ms ({gflop / ms * 1e3:.0f} GFLOP/s)" for name, ms in times.items())
            print(f"{k}->{n} rows={m}: {cols}", flush=True)
    print(f"per step ({LAYERS} layers + LM head), ms:")
    for m in rows:
        print(f"  rows={m}: " + ", ".join(f"{name} {ms:.1f}" for (r, name), ms in totals.items() if r == m))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 64, 256])
