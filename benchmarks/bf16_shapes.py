"""Per-shape timing of the two bf16 linear paths of a CPU with AVX512-BF16: oneDNN's prepacked GEMM (kvserve's
choice before the eighth session) and kvserve's pair panels (kernels/csrc/linear_bf16.cpp, `vdpbf16ps`), for
SmolLM2-135M's weight shapes at several row counts, and whether each gives a row the same bits alone as inside a
batch (batch invariance: a request's greedy tokens must not depend on what it is batched with). Where the CPU has
AMX-BF16, the pairs are also timed on AMX tiles (`pairs-AMX`, kvserve's path there; `pairs` is then the
AVX512-BF16 path that KVSERVE_CPU_AMX=0 keeps).

Each shape gets 30 distinct weight copies used in turn (as 30 layers would be), so the weights come from memory
rather than cache; the LM head gets one. Reports the best of 5 timings of 10 calls each (ms) and per-step totals
(30 layers + LM head). Run: `.venv/bin/python benchmarks/bf16_shapes.py 1 64 128`.
"""

from __future__ import annotations

import sys

import torch

import kvserve  # noqa: F401  (applies KVSERVE_CPU_ISA's caps to torch before it runs anything)
from benchmarks.linear_shapes import LAYERS, SHAPES, best_ms
from kvserve.kernels.cpu import load_cpu_kernels
from kvserve.platform import cpu_info


def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def batch_invariant(fn, x: torch.Tensor) -> bool:
    """Each row's output alone equals its output inside the whole batch, bit for bit."""
    alone = torch.cat([fn(x[i : i + 1]) for i in range(len(x))])
    return torch.equal(fn(x), alone)


def paths(kernels, n: int, packed: list, pairs: list) -> dict:
    """Each path as fn(x, copy index): oneDNN, the pairs on AVX512-BF16 vectors, and (where the CPU has AMX-BF16)
    the same pairs on AMX tiles."""

    def on(amx: bool):
        def run(x, i):
            kernels.linear_amx_set_enabled(amx)
            return kernels.linear_bf16_pairs(x, pairs[i % len(pairs)], n)

        return run

    fns = {"oneDNN": lambda x, i: onednn(x, packed[i % len(packed)]), "pairs": on(False)}
    kernels.linear_amx_set_enabled(True)
    if kernels.linear_bf16_amx_active():
        fns["pairs-AMX"] = on(True)
    return fns


def time_paths(fns: dict, x: torch.Tensor) -> dict[str, float]:
    """Best ms per call of each path, taking the weight copies in turn."""
    turn = iter(range(10**9))
    return {name: best_ms(lambda fn=fn: fn(x, next(turn))) for name, fn in fns.items()}


def main(rows: list[int]) -> None:
    kernels = load_cpu_kernels()
    info = cpu_info()
    if kernels is None or not info.native_bf16 or not kernels.linear_bf16_pairs_supported():
        sys.exit("needs the C++ kernels built for AVX512-BF16")
    print(info.describe())
    torch.manual_seed(0)
    totals: dict[tuple[int, str], float] = {}
    for k, n in SHAPES:
        copies = 1 if n > 10_000 else LAYERS
        plain = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in plain]
        pairs = [kernels.pack_linear_weight_bf16_pairs(w) for w in plain]
        fns = paths(kernels, n, packed, pairs)
        probe = torch.randn(64, k).bfloat16()
        invariant = {name: batch_invariant(lambda a, fn=fn: fn(a, 0), probe) for name, fn in fns.items()}
        for m in rows:
            times = time_paths(fns, torch.randn(m, k).bfloat16())
            print(
                f"{k}x{n:<6} rows {m:>4}: "
                + "  ".join(f"{name} {ms:7.3f}" for name, ms in times.items())
                + f"  pairs/oneDNN {times['pairs'] / times['oneDNN']:.2f}"
            )
            for name, ms in times.items():
                totals[(m, name)] = totals.get((m, name), 0.0) + (1 if n > 10_000 else LAYERS) * ms
        print(f"{k}x{n:<6} batch-invariant (64 rows): " + "  ".join(f"{a} {b}" for a, b in invariant.items()))
    for m in rows:
        step = {name: ms for (r, name), ms in totals.items() if r == m}
        print(
            f"step total, rows {m:>4}: "
            + "  ".join(f"{name} {ms:7.2f}" for name, ms in step.items())
            + f"  pairs/oneDNN {step['pairs'] / step['oneDNN']:.2f}"
        )


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 64, 128])
