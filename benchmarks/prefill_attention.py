"""The prefill attention of the offline workload (`kvserve bench throughput --num-requests 64 --input-len 64 384`),
kernel only, fp32: 64 prompts of 64-384 tokens cut into steps of at most 2,048 tokens (the default budget; a prompt
that does not fit is chunked), each step's prompt tokens as rows of one call per layer, 30 layers with their own
caches (SmolLM2-135M's shape: 9 heads, 3 kv heads, head_dim 64, block 16).

    .venv/bin/python benchmarks/prefill_attention.py [rounds]

Times the row walk (every query token by itself, as deterministic mode runs it) against the tile path
(paged_attention_chunk.cpp, the non-deterministic default), interleaved, after checking that they agree.
"""

import statistics
import sys
import time

import numpy as np
import torch

from kvserve.kernels.cpu import load_cpu_kernels

H, HKV, D, B, L, BUDGET = 9, 3, 64, 16, 30, 2048


def steps(prompt_lens: np.ndarray) -> list[list[tuple[int, int, int]]]:
    """(prompt, first position, tokens) per chunk, per step, first come first served under the budget."""
    out, step, room = [], [], BUDGET
    for i, n in enumerate(prompt_lens):
        pos = 0
        while pos < n:
            take = min(n - pos, room)
            step.append((i, pos, take))
            pos, room = pos + take, room - take
            if room == 0:
                out.append(step)
                step, room = [], BUDGET
    return out + ([step] if step else [])


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    kernels = load_cpu_kernels()
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    prompt_lens = rng.integers(64, 385, 64)
    nb = (prompt_lens + B - 1) // B
    pool = int(nb.sum() * 1.3)
    caches = [(torch.randn(pool, B, HKV, D), torch.randn(pool, B, HKV, D)) for _ in range(L)]
    perm = rng.permutation(pool)[: nb.sum()].astype(np.int32)
    tables = np.split(perm, np.cumsum(nb)[:-1])
    calls, flops = [], 0.0
    for step in steps(prompt_lens):
        rows_table, lens, chunks, row = [], [], [], 0
        for i, pos, take in step:
            t = np.zeros(nb.max(), np.int32)
            t[: nb[i]] = tables[i]
            rows_table += [t] * take
            lens += list(range(pos + 1, pos + take + 1))
            chunks.append((row, take))
            row += take
            flops += sum(range(pos + 1, pos + take + 1)) * H * D * 4 * L
        q = torch.randn(row, H, D)
        calls.append((q, torch.from_numpy(np.stack(rows_table)), torch.tensor(lens), torch.tensor(chunks)))

    def attend(call, cache, tiles: bool) -> torch.Tensor:
        q, table, lens, chunks = call
        return kernels.paged_attention_decode(q, *cache, table, lens, 0.125, chunks=chunks if tiles else None)

    def run(tiles: bool) -> None:
        for call in calls:
            for cache in caches:
                attend(call, cache, tiles)

    for call in calls:
        torch.testing.assert_close(attend(call, caches[0], True), attend(call, caches[0], False), atol=2e-5, rtol=2e-5)
    times = {"rows": [], "tiles": []}
    for _ in range(rounds):
        for name in times:
            t0 = time.perf_counter()
            run(name == "tiles")
            times[name].append(time.perf_counter() - t0)
    print(f"{len(calls)} steps x {L} layers, {flops / 1e9:.0f} GFLOP (causal pairs x 4 x head_dim x heads)")
    for name, ts in times.items():
        t = statistics.median(ts)
        each = ", ".join(f"{x:.2f}" for x in ts)
        print(f"{name}: {t:.2f} s (median of {rounds}: {each}), {flops / t / 1e9:.0f} GFLOP/s")
    print(f"tiles / rows: {statistics.median(times['rows']) / statistics.median(times['tiles']):.2f}x")


if __name__ == "__main__":
    main()
