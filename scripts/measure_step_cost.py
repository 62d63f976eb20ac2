"""Measure a target step's cost against its number of query tokens, for the adaptive speculation rule.

    PYTHONPATH=. python scripts/measure_step_cost.py [--context 256] [--repeat 10] [--out FILE.json]

R running requests, each with `context` tokens in its KV cache and q query tokens this step (q = 1: a plain
decode; q = 1 + k: verifying k drafts), go through the model's forward and the LM head at every query position,
as the runner does when it verifies drafts. Prints the median ms per step for R in 1..64 and q in 1..5, and the
marginal cost of the drafts' tokens against the plain decode step of the same R. The KV contents are whatever the
pool holds (timing only). kvserve.core.spec_policy's FLAT_STEP_TOKENS is read off this table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from kvserve import LLM
from kvserve.attention.base import AttentionInputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32, 48, 64])
    ap.add_argument("--query-lens", type=int, nargs="+", default=[1, 2, 3, 5])
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    bs = 16
    max_r, max_q = max(ns.batch_sizes), max(ns.query_lens)
    blocks_per_req = -(-(ns.context + max_q) // bs)
    llm = LLM(ns.model, max_model_len=ns.context + max_q + 16, num_kv_blocks=max_r * blocks_per_req + 1)
    runner = llm.engine.engine_core.executor.driver_runner
    model, backend = runner.model, runner.attn_backend
    table = np.arange(max_r * blocks_per_req, dtype=np.int32).reshape(max_r, blocks_per_req)
    results = []
    with torch.inference_mode():
        for r in ns.batch_sizes:
            for q in ns.query_lens:
                positions = np.tile(np.arange(ns.context, ns.context + q), r)
                rows = np.repeat(np.arange(r), q)
                slots = table[rows, positions // bs].astype(np.int64) * bs + positions % bs
                md = backend.build_metadata(
                    AttentionInputs(
                        num_decodes=r if q == 1 else 0,
                        query_start_loc=np.arange(r + 1, dtype=np.int64) * q,
                        seq_lens=np.full(r, ns.context + q, dtype=np.int64),
                        block_table=table[:r],
                        slot_mapping=slots,
                        block_size=bs,
                    )
                )
                ids = torch.randint(0, 1000, (r * q,))
                pos = torch.from_numpy(positions)
                times = []
                for i in range(ns.repeat + 3):
                    start = time.perf_counter()
                    hidden = model(ids, pos, runner.kv_caches, md)
                    model.compute_logits(hidden)
                    if i >= 3:
                        times.append((time.perf_counter() - start) * 1e3)
                results.append({"batch": r, "query_len": q, "tokens": r * q, "ms": statistics.median(times)})
                print(f"R={r:3d} q={q} tokens={r * q:4d} {results[-1]['ms']:8.2f} ms", flush=True)
    base = {x["batch"]: x["ms"] for x in results if x["query_len"] == 1}
    print("\nR   q  step ms  x decode step  extra ms per draft token")
    for x in results:
        extra = (x["ms"] - base[x["batch"]]) / max(1, x["tokens"] - x["batch"])
        x["vs_decode"] = x["ms"] / base[x["batch"]]
        x["extra_ms_per_draft_token"] = extra if x["query_len"] > 1 else 0.0
        extra = x["extra_ms_per_draft_token"]
        print(f"{x['batch']:3d} {x['query_len']}  {x['ms']:7.2f}  {x['vs_decode']:5.2f}  {extra:6.3f}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(
                {"context": ns.context, "torch_threads": torch.get_num_threads(), "results": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
