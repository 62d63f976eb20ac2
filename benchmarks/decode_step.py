"""Batch-1 decode time per step through the offline API, the default engine and the embedded model: one greedy
request, the difference of a 288-token and a 32-token run over 256 steps (prefill and start-up cancel), three
times; then three of `kvserve bench roofline`'s steady-state batch-1 points in the same engine.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/decode_step.py [label] [--async-scheduling]` (PYTHONPATH=<other
checkout> to compare).
"""

from __future__ import annotations

import sys
import time

from kvserve import LLM, SamplingParams
from kvserve.benchmarks.roofline import decode_throughput


def main(label: str, async_scheduling: bool) -> None:
    llm = LLM(max_model_len=1024, async_scheduling=async_scheduling)
    prompt = {"prompt_token_ids": list(range(100, 228))}

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    run(16)
    per_step = []
    for _ in range(3):
        short, long = run(32), run(288)
        per_step.append((long - short) / 256 * 1e3)
    print(label, "ms/token (generate, difference)", [round(ms, 2) for ms in per_step])
    points = [decode_throughput(llm, 1, 128, 128, seed=s).ms_per_step for s in range(3)]
    print(label, "ms/step (bench roofline's decode_throughput)", [round(ms, 2) for ms in points])


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--async-scheduling"]
    main(args[0] if args else "kvserve", "--async-scheduling" in sys.argv[1:])
