"""Speculation that never loses: each proposer x batch size x workload, the cost-aware policy on vs speculation
off, in the same run (one `kvserve bench throughput --ablate speculative` per cell, greedy).

    PYTHONPATH=. python benchmarks/spec_policy.py [--proposers ngram eagle eagle-tree draft] [--batch-sizes 1 8 64] \\
        [--workloads chat random] [--repeat 1] [--waves 1] [--output-len MIN MAX] [--head DIR] \\
        [--draft-vocab-size N] [--draft-quantization int8] [--json FILE]

Workloads: `chat` (natural questions, nothing to copy; kvserve.benchmarks.datasets) and `random` (random-token
prompts). Batch b runs max(b, 3) requests with at most b at a time (max-num-seqs b). Proposers: n-gram (K = 4), the
EAGLE head of scripts/train_eagle_head.py (K = 4; `eagle-tree`: EAGLE-2 trees of depth 4, top-k 4, 12 nodes), the
6-layer early exit of scripts/make_truncated_draft.py (K = 3). Prints one markdown row per cell: output tok/s with
the policy and without speculation, their ratio (of the medians, and the median of the ABBA pairs' own ratios), and
the drafts verified (the policy leaves most requests out where drafts do not pay).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from kvserve.benchmarks import throughput
from kvserve.loader.default_model import DEFAULT_MODEL, cache_dir

PROPOSERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "eagle": {"method": "eagle", "num_speculative_tokens": 4},
    "eagle-tree": {"method": "eagle", "tree_depth": 4, "tree_topk": 4, "tree_num_nodes": 12},
    "draft": {
        "method": "draft_model",
        "model": os.path.join(cache_dir(), "drafts", f"{DEFAULT_MODEL}-6l"),
        "num_speculative_tokens": 3,
    },
}
OUTPUT_LEN = {1: (96, 96), 8: (64, 96), 64: (48, 64)}


def cell_args(
    proposer: str,
    workload: str,
    batch: int,
    repeat: int,
    out: str,
    waves: int,
    output_len: list[int] | None,
    eagle: dict | None = None,
) -> argparse.Namespace:
    """`eagle`: keys added to the EAGLE proposers' configs (--head, --draft-vocab-size, --draft-quantization)."""
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    lo, hi = output_len or OUTPUT_LEN.get(batch, (64, 96))
    argv = [
        "throughput",
        "--dataset",
        workload,
        "--num-requests",
        str(max(batch, 3) * waves),
        "--input-len",
        "64",
        "128",
        "--output-len",
        str(lo),
        str(hi),
        "--temperature",
        "0",
        "--max-num-seqs",
        str(batch),
        "--ablate",
        "speculative",
        "--repeat",
        str(repeat),
        "--speculative-config",
        json.dumps({**PROPOSERS[proposer], **(eagle or {})} if proposer.startswith("eagle") else PROPOSERS[proposer]),
        "--json",
        out,
    ]
    return parser.parse_args(argv)


def pairwise_ratio(runs: dict[str, list[dict]]) -> float:
    """The median of each ABBA pair's own ratio (run i with speculation against run i without: adjacent in time),
    which the machine's drift between pairs moves less than the ratio of the two medians does."""
    on = [r["output_tokens_per_s"] for r in runs["kvserve"]]
    off = [r["output_tokens_per_s"] for r in runs["kvserve (speculative off)"]]
    return statistics.median(a / b for a, b in zip(on, off, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proposers", nargs="+", choices=list(PROPOSERS), default=list(PROPOSERS))
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--workloads", nargs="+", choices=["chat", "random"], default=["chat", "random"])
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration (ABBA order; the median counts)")
    ap.add_argument("--json", default=None, help="write every cell's results here")
    ap.add_argument("--waves", type=int, default=1, help="requests per cell: max(batch, 3) times this")
    ap.add_argument("--output-len", type=int, nargs=2, default=None, help="output length range (default by batch)")
    ap.add_argument("--head", default=None, help="the EAGLE head's folder (default: the embedded model's)")
    ap.add_argument("--draft-vocab-size", type=int, default=0, help="the EAGLE head's draft vocabulary (0: full)")
    ap.add_argument("--draft-quantization", default=None, help="the EAGLE head's weights: int8")
    ns = ap.parse_args()
    eagle: dict = {"model": ns.head} if ns.head else {}
    eagle.update({"draft_vocab_size": ns.draft_vocab_size} if ns.draft_vocab_size else {})
    eagle.update({"quantization": ns.draft_quantization} if ns.draft_quantization else {})
    rows, cells = [], []
    for proposer in ns.proposers:
        for workload in ns.workloads:
            for batch in ns.batch_sizes:
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "cell.json")
                    throughput.main(
                        cell_args(proposer, workload, batch, ns.repeat, out, ns.waves, ns.output_len, eagle)
                    )
                    with open(out) as f:
                        result = json.load(f)
                on, off = result["results"][0], result["results"][1]
                spec = result["kvserve_stats_by_config"]["kvserve"].get("spec_decoding_this_run", {})
                ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"]
                pairwise = pairwise_ratio(result["kvserve_runs"])
                cells.append(
                    {
                        "proposer": proposer,
                        "workload": workload,
                        "batch": batch,
                        "ratio": ratio,
                        "pairwise_ratio": pairwise,
                        **result,
                    }
                )
                row = (
                    f"| {proposer} | {workload} | {batch} | {on['output_tokens_per_s']:.1f} | "
                    f"{off['output_tokens_per_s']:.1f} | **{ratio:.3f}x** | {pairwise:.3f}x | "
                    f"{spec.get('num_draft_tokens', 0)} / "
                    f"{spec.get('num_drafts', 0)}, acceptance {spec.get('acceptance_rate', 0.0):.2f} |"
                )
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
    print(
        "| proposer | workload | batch | policy on (tok/s) | off (tok/s) | ratio | pairwise | "
        "draft tokens / drafts verified |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(cells, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
