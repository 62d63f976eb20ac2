"""Per-shape timing of kvserve's int4 linear (kernels/csrc/int4_linear.cpp: activations quantized per block of 32,
4-bit panels, per-block float epilogue) against kvserve's fp32 panel kernel, SmolLM2-135M's weight shapes (the LM
head stays int8 with int4 weights, so it is left out), at several row counts; also the activation quantization alone.

Each shape gets 30 distinct weight copies used in turn (as 30 layers would be). Reports the best of 5 timings of 10
calls each (ms) and per-step totals over the 30 layers. Run: `.venv/bin/python benchmarks/int4_shapes.py 1 64 256`
(prefix KVSERVE_CPU_ISA=avx2 for the AVX2 path).
"""

from __future__ import annotations

import sys

import torch

import kvserve  # noqa: F401  (applies KVSERVE_CPU_ISA's caps to torch before it runs anything)
from benchmarks.linear_shapes import LAYERS, SHAPES, best_ms
from kvserve.kernels.cpu import load_cpu_kernels
from kvserve.layers.quant.int4_linear import pack_int4_weight, quantize_q4_1
from kvserve.platform import cpu_info


def time_paths(kernels, x: torch.Tensor, n: int, int4: list, panels: list) -> dict:
    """Best ms per call of each path, taking the weight copies in turn."""
    turn = iter(range(10**9))
    return {
        "int4": best_ms(lambda: kernels.int4_linear(x, int4[next(turn) % LAYERS], n)),
        "int4 quantize": best_ms(lambda: kernels.int4_quantize_rows(x)),
        "fp32": best_ms(lambda: kernels.linear_packed(x, panels[next(turn) % LAYERS], n)),
    }


def main(rows: list[int]) -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        sys.exit("the C++ kernels did not load")
    print(cpu_info().describe(), kernels.vector_isa())
    torch.manual_seed(0)
    totals: dict[tuple[int, str], float] = {}
    for k, n in [s for s in SHAPES if s[1] < 10_000]:
        plain = [torch.randn(n, k) * 0.05 for _ in range(LAYERS)]
        int4 = [pack_int4_weight(*quantize_q4_1(w)) for w in plain]
        panels = [kernels.pack_linear_weight(w) for w in plain]
        for m in rows:
            times = time_paths(kernels, torch.randn(m, k), n, int4, panels)
            ratio = times["fp32"] / times["int4"]
            cols = "  ".join(f"{name} {ms:7.3f}" for name, ms in times.items())
            print(f"{k}x{n:<5} rows {m:>4}: {cols}  fp32/int4 {ratio:.2f}x", flush=True)
            for name, ms in times.items():
                totals[(m, name)] = totals.get((m, name), 0.0) + LAYERS * ms
    for m in rows:
        step = "  ".join(f"{name} {ms:7.2f}" for (r, name), ms in totals.items() if r == m)
        print(f"step total, rows {m:>4}: {step}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 64, 256])
