"""Sustained fp32 GEMM rate of SmolLM2-135M's 30 layers (four weight shapes, 30 copies each, so the weights come
from memory as in a run) at one row count: kvserve's panel kernel against torch's F.linear and oneDNN's prepacked
linear, each for `--seconds` in a fresh process, the three alternated for `--rounds`.

    PYTHONPATH=. .venv/bin/python benchmarks/gemm_sustained.py [--rows 2048] [--seconds 8] [--rounds 2]

Why: short timings (linear_shapes.py's best of 5) catch the bursts of a shared VM; a prompt's linears in a run
last seconds, and at 2 threads the panels kept less of their one-thread lead over torch there (docs/benchmarks.md,
"The fp32 GEMM on two threads, sustained").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
LAYERS = 30
MODES = ("panels", "torch", "onednn")


def run_one(mode: str, rows: int, seconds: float, threads: int) -> float:
    """GFLOP/s of `mode` over the 30 layers' four linears, sustained for `seconds`."""
    import torch
    import torch.nn.functional as F

    import kvserve  # noqa: F401  (applies KVSERVE_CPU_ISA's caps to torch)
    from kvserve.kernels.cpu import load_cpu_kernels

    torch.set_num_threads(threads)
    kernels = load_cpu_kernels()
    weights = [[torch.randn(n, k) for _ in range(LAYERS)] for k, n in SHAPES]
    if mode == "panels":
        held = [[kernels.pack_linear_weight(w) for w in ws] for ws in weights]
    elif mode == "onednn":
        held = [[torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws] for ws in weights]
    else:
        held = weights
    xs = {k: torch.randn(rows, k) for k, _ in SHAPES}

    def step() -> None:
        for layer in range(LAYERS):
            for (k, n), ws in zip(SHAPES, held, strict=True):
                if mode == "panels":
                    kernels.linear_packed(xs[k], ws[layer], n, None)
                elif mode == "onednn":
                    torch.ops.mkldnn._linear_pointwise(xs[k], ws[layer], None, "none", [], "")
                else:
                    F.linear(xs[k], ws[layer])

    step()
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        step()
        steps += 1
    flops = sum(2 * rows * k * n for k, n in SHAPES) * LAYERS * steps
    return flops / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # the child process's mode
    a = p.parse_args()
    if a.one:
        print(f"{run_one(a.one, a.rows, a.seconds, a.threads):.1f}")
        return
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                mode,
                "--rows",
                str(a.rows),
                "--seconds",
                str(a.seconds),
                "--threads",
                str(a.threads),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
            rates[mode].append(float(out[-1]))
            print(f"round {r + 1} {mode:<7} {rates[mode][-1]:6.1f} GFLOP/s", flush=True)
    for mode, v in rates.items():
        print(f"{mode:<7} {' '.join(f'{x:.0f}' for x in v)}  (rows {a.rows}, {a.threads} threads)")


if __name__ == "__main__":
    main()
