"""EAGLE with the full vs a frequency-ranked draft vocabulary (kvserve.spec_decode.draft_vocab), each against
speculation off in the same run (one `kvserve bench throughput --ablate speculative` per cell, greedy, batch 1,
the `chat` workload: natural questions, nothing to copy).

    PYTHONPATH=. python benchmarks/spec_draft_vocab.py --head DIR [--sizes 0 16384] [--policies on off] \\
        [--quantization none int8] [-k 4] [--num-requests 4] [--output-len 128 128] [--repeat 1] [--json FILE]

`--sizes 0` is the full vocabulary; `--policies off` is fixed K (`adaptive: false`). Prints one markdown row per
cell: output tok/s with EAGLE and without speculation, their ratio, the drafts verified and the mean acceptance
length (1 + accepted tokens per verified draft run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from kvserve.benchmarks import throughput


def cell_args(ns: argparse.Namespace, size: int, policy: str, quantization: str, out: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    config = {"method": "eagle", "model": ns.head, "num_speculative_tokens": ns.k, "adaptive": policy == "on"}
    if size:
        config["draft_vocab_size"] = size
    argv = ["throughput", "--dataset", "chat", "--num-requests", str(ns.num_requests), "--input-len", "64", "128"]
    argv += ["--output-len", *map(str, ns.output_len), "--temperature", "0", "--max-num-seqs", "1"]
    argv += ["--ablate", "speculative", "--repeat", str(ns.repeat), "--speculative-config", json.dumps(config)]
    argv += ["--json", out] + ([] if quantization == "none" else ["--quantization", quantization])
    return parser.parse_args(argv)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="the EAGLE head's folder (with token_counts.npy)")
    ap.add_argument("--sizes", nargs="+", type=int, default=[0, 16384])
    ap.add_argument("--policies", nargs="+", choices=["on", "off"], default=["on", "off"])
    ap.add_argument("--quantization", nargs="+", choices=["none", "int8"], default=["none", "int8"])
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=4)
    ap.add_argument("--output-len", type=int, nargs=2, default=[128, 128])
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration (ABBA order; the median counts)")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    rows, cells = [], []
    for quantization in ns.quantization:
        for policy in ns.policies:
            for size in ns.sizes:
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "cell.json")
                    throughput.main(cell_args(ns, size, policy, quantization, out))
                    with open(out) as f:
                        result = json.load(f)
                on, off = result["results"][0], result["results"][1]
                spec = result["kvserve_stats_by_config"]["kvserve"].get("spec_decoding_this_run", {})
                ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"]
                cell = {"quantization": quantization, "policy": policy, "draft_vocab_size": size, "ratio": ratio}
                cells.append({**cell, **result})
                row = (
                    f"| {'bf16' if quantization == 'none' else quantization} | {'on' if policy == 'on' else 'fixed K'} "
                    f"| {size or 'full'} | {on['output_tokens_per_s']:.1f} | {off['output_tokens_per_s']:.1f} | "
                    f"**{ratio:.3f}x** | {spec.get('num_draft_tokens', 0)} / {spec.get('num_drafts', 0)} | "
                    f"{spec.get('acceptance_rate', 0.0):.3f} | {spec.get('mean_acceptance_length', 0.0):.2f} |"
                )
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
    header = (
        "| weights | policy | draft vocab | EAGLE tok/s | off tok/s | ratio | draft tokens / drafts | acc. | mean len |"
    )
    print(header)
    print("|---|---|---|---:|---:|---:|---|---:|---:|")
    print("\n".join(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(cells, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
