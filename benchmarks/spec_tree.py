"""EAGLE draft trees vs the EAGLE chain with the same head, each against speculation off in the same run (one
`kvserve bench throughput --ablate speculative` per cell, batch 1, the `chat` workload; greedy unless
`--temperature`).

    PYTHONPATH=. python benchmarks/spec_tree.py --head DIR [--dtype float32] [-k 4] [--tree 4 4 12] \\
        [--draft-vocab-size 0] [--quantization int8] [--draft-quantization int8] [--num-requests 4] \\
        [--output-len 128 128] [--temperature 0] [--repeat 1] [--json FILE]

float32 by default (the first figures' dtype); `--dtype bfloat16` runs trees on the pair-packed KV layout where the
CPU has AVX512-BF16 (its kernel reads the tree mask). Fixed K (`adaptive: false`) for both cells. Prints one
markdown row per cell: output tok/s with EAGLE and without speculation, their ratio, the draft tokens and drafts
verified, the mean acceptance length (1 + accepted tokens per verified chain or tree).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from kvserve.benchmarks import throughput


def cell_args(ns: argparse.Namespace, config: dict, out: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    argv = ["throughput", "--dataset", "chat", "--num-requests", str(ns.num_requests), "--input-len", "64", "128"]
    argv += ["--output-len", *map(str, ns.output_len), "--temperature", str(ns.temperature), "--max-num-seqs", "1"]
    argv += ["--dtype", ns.dtype, "--ablate", "speculative", "--speculative-config", json.dumps(config)]
    argv += ["--quantization", ns.quantization] if ns.quantization else []
    argv += ["--repeat", str(ns.repeat), "--json", out]
    return parser.parse_args(argv)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="the EAGLE head's folder")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("-k", type=int, default=4, help="the chain's drafts per step")
    ap.add_argument("--tree", type=int, nargs=3, default=[4, 4, 12], metavar=("DEPTH", "TOPK", "NODES"))
    ap.add_argument("--draft-vocab-size", type=int, default=0, help="0: the full vocabulary")
    ap.add_argument("--quantization", default=None, help="the target's weights: int8 or int4")
    ap.add_argument("--draft-quantization", default=None, help="the head's weights (speculative config): int8")
    ap.add_argument("--repeat", type=int, default=1, help="runs per cell in ABBA order (each cell's median run)")
    ap.add_argument("--num-requests", type=int, default=4)
    ap.add_argument("--output-len", type=int, nargs=2, default=[128, 128])
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled (trees walk the target's draws)")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    base = {"method": "eagle", "model": ns.head, "adaptive": False, "draft_vocab_size": ns.draft_vocab_size}
    if ns.draft_quantization:
        base["quantization"] = ns.draft_quantization
    depth, topk, nodes = ns.tree
    cells = {
        f"chain K={ns.k}": {**base, "num_speculative_tokens": ns.k},
        f"tree depth {depth}, top-k {topk}, {nodes} nodes": {
            **base,
            "tree_depth": depth,
            "tree_topk": topk,
            "tree_num_nodes": nodes,
        },
    }
    rows, results = [], []
    weights = f"{ns.dtype} {ns.quantization}" if ns.quantization else ns.dtype
    weights += f", head {ns.draft_quantization}" if ns.draft_quantization else ""
    for name, config in cells.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "cell.json")
            throughput.main(cell_args(ns, config, out))
            with open(out) as f:
                result = json.load(f)
        on, off = result["results"][0], result["results"][1]
        spec = result["kvserve_stats_by_config"]["kvserve"].get("spec_decoding_this_run", {})
        ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"]
        results.append({"cell": name, "ratio": ratio, **result})
        row = (
            f"| {name} | {weights} | {on['output_tokens_per_s']:.1f} | {off['output_tokens_per_s']:.1f} | "
            f"**{ratio:.3f}x** | {spec.get('num_draft_tokens', 0)} / {spec.get('num_drafts', 0)} | "
            f"{spec.get('mean_acceptance_length', 0.0):.2f} |"
        )
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    print("| EAGLE | dtype | EAGLE tok/s | off tok/s | ratio | draft tokens / drafts | mean acc. length |")
    print("|---|---|---:|---:|---:|---|---:|")
    print("\n".join(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
