"""Per-shape timing of kvserve's int8 linear (kernels/csrc/int8_linear.cpp: per-token quantization with the block
rotation, int8 GEMV/GEMM, rescale) against the other ways to run the layer on this CPU: fbgemm's dynamic int8
linear (torch.ops.quantized.linear_dynamic, per-tensor activation range: a lower bound of what a per-token fbgemm
route costs), oneDNN's prepacked bf16 GEMM (where bf16 is native) and kvserve's fp32 panel kernel. SmolLM2-135M's
weight shapes, at several row counts. On a CPU with AMX-INT8 kvserve's batched rows run on AMX tiles;
`int8 kvserve vectors` is then the AVX512-VNNI path that KVSERVE_CPU_AMX=0 keeps.

Each shape gets 30 distinct weight copies used in turn (as 30 layers would be), so the weights come from memory
rather than cache; the LM head gets one. Reports the best of 5 timings of 10 calls each (ms), and per-step totals
(30 layers + LM head). Run: `.venv/bin/python benchmarks/int8_shapes.py 1 64 256` (prefix KVSERVE_CPU_ISA=avx2 for
the AVX2 path).
"""

from __future__ import annotations

import sys
import warnings

import torch

import kvserve  # noqa: F401  (applies KVSERVE_CPU_ISA's caps to torch before it runs anything)
from benchmarks.linear_shapes import LAYERS, SHAPES, best_ms
from kvserve.kernels.cpu import load_cpu_kernels
from kvserve.layers.quant.int8_linear import Int8Linear
from kvserve.platform import cpu_info


def fbgemm_dynamic(w: torch.Tensor):
    """fbgemm's prepacked int8 weight (per output channel) for quantized.linear_dynamic."""
    codes_scale = torch.quantize_per_channel(
        w, w.abs().amax(1) / 127, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8
    )
    return torch.ops.quantized.linear_prepack(codes_scale, None)


def time_paths(kernels, x: torch.Tensor, n: int, int8: list, fbgemm: list, panels: list, bf16: list) -> dict:
    """Best ms per call of each path, taking the weight copies in turn."""
    xb, turn = x.bfloat16(), iter(range(10**9))

    def pick(held: list):
        return held[next(turn) % len(held)]

    def vectors():
        kernels.linear_amx_set_enabled(False)
        try:
            return pick(int8)(x)
        finally:
            kernels.linear_amx_set_enabled(True)

    paths = {
        "int8 kvserve": lambda: pick(int8)(x),
        "int8 fbgemm": lambda: torch.ops.quantized.linear_dynamic(x, pick(fbgemm), True),
        "fp32 panels": lambda: kernels.linear_packed(x, pick(panels), n),
    }
    if kernels.int8_linear_amx_active():  # then "int8 kvserve" is on AMX tiles: the vectors beside it
        paths["int8 kvserve vectors"] = vectors
    if bf16:
        paths["bf16 oneDNN"] = lambda: torch.ops.mkldnn._linear_pointwise(xb, pick(bf16), None, "none", [], "")
    return {name: best_ms(fn) for name, fn in paths.items()}


def main(rows: list[int]) -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        sys.exit("the C++ kernels did not load")
    warnings.simplefilter("ignore")  # quantized tensors are deprecated
    info = cpu_info()
    print(info.describe())
    torch.manual_seed(0)
    totals: dict[tuple[int, str], float] = {}
    for k, n in SHAPES:
        copies = 1 if n > 10_000 else LAYERS
        plain = [torch.randn(n, k) * 0.05 for _ in range(copies)]
        int8 = [Int8Linear.from_float(w) for w in plain]
        fbgemm = [fbgemm_dynamic(w) for w in plain]
        panels = [kernels.pack_linear_weight(w) for w in plain]
        bf16 = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64) for w in plain] if info.native_bf16 else []
        for m in rows:
            times = time_paths(kernels, torch.randn(m, k), n, int8, fbgemm, panels, bf16)
            print(f"{k}x{n:<6} rows {m:>4}: " + "  ".join(f"{name} {ms:7.3f}" for name, ms in times.items()))
            layers = 1 if n > 10_000 else LAYERS
            for name, ms in times.items():
                totals[(m, name)] = totals.get((m, name), 0.0) + layers * ms
    for m in rows:
        step = [f"{name} {ms:7.2f}" for (r, name), ms in totals.items() if r == m]
        print(f"step total, rows {m:>4}: " + "  ".join(step))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 64, 256])
