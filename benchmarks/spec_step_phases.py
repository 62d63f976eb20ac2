"""Where a speculative step's time goes: speculation off and EAGLE variants in one process, batch 1, the `chat`
workload, greedy, in ABBA order (the engines' runs interleaved, so the VM's drift hits them alike), with the engine's
own phase timer (kvserve/profiling.py: schedule, prepare_inputs, forward, logits (with a tree's draw and walk),
propose, sample, update).

    PYTHONPATH=. python benchmarks/spec_step_phases.py --head DIR [--dtype bfloat16] [--quantization int8] \\
        [--repeat 6] [--num-requests 4] [--output-len 128] \\
        tree=depth,topk,nodes[,draft_vocab_size[,int8][,policy]][@DIR] chain=0,0,K[,...] ...

A variant is name=depth,topk,nodes with depth 0 for a chain of `nodes` drafts; the optional fourth field is the draft
vocabulary (0: full); then `int8` quantizes the head, `policy` turns the cost-aware policy on (else fixed sizes,
`adaptive: false`); `@DIR` at the end gives the variant its own head (else --head's). Prints each engine's median
output tok/s, the median of its per-repetition ratios to speculation off (with their range), the mean acceptance
length, and ms per step by phase.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from kvserve.benchmarks.datasets import DatasetSpec, build_dataset
from kvserve.benchmarks.throughput import run_kvserve
from kvserve.engine.llm import LLM


def variant_config(spec: str, head: str) -> dict:
    spec, _, own_head = spec.partition("@")  # a variant's own head folder, to set two heads side by side
    head = own_head or head
    fields = spec.split(",")
    depth, topk, nodes = map(int, fields[:3])
    # Fixed sizes unless the variant names `policy` (the cost-aware policy, the default outside benchmarks).
    config = {"method": "eagle", "model": head, "adaptive": "policy" in fields[4:]}
    config["draft_vocab_size"] = int(fields[3]) if len(fields) > 3 else 0
    if "int8" in fields[4:]:
        config["quantization"] = "int8"
    if depth:
        config.update(tree_depth=depth, tree_topk=topk, tree_num_nodes=nodes)
    else:
        config["num_speculative_tokens"] = nodes
    return config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="the EAGLE head's folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, help="the target's weights")
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--num-requests", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("variants", nargs="+", help="name=depth,topk,nodes[,draft_vocab_size[,int8][,policy]][@DIR]")
    ns = ap.parse_args()
    common = {"dtype": ns.dtype, "max_num_seqs": 1, "quantization": ns.quantization}
    engines = {"off": LLM(**common)}
    for v in ns.variants:
        name, spec = v.split("=", 1)
        engines[name] = LLM(speculative_config=variant_config(spec, ns.head), **common)
    spec = DatasetSpec("chat", ns.num_requests, seed=0, input_len=(64, 128), output_len=(ns.output_len,) * 2)
    requests = build_dataset(spec, 0, engines["off"].get_tokenizer())
    for llm in engines.values():  # warm-up: kernel selection, the allocator
        run_kvserve(llm, requests[:1], "warm-up", 0.0)
        timer = llm.engine.engine_core.timer
        timer.reset()
        timer.enabled = True
    names = list(engines)
    tok_s: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(ns.repeat):
        for name in names if rep % 2 == 0 else names[::-1]:
            tok_s[name].append(run_kvserve(engines[name], requests, name, 0.0).output_tokens_per_s)
        print(f"repetition {rep}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in tok_s.items()), file=sys.stderr)
    phases = sorted({p for llm in engines.values() for p in llm.engine.engine_core.timer.seconds})
    print("| engine | tok/s | ratio (range) | mean acc. length | " + " | ".join(phases) + " | step (ms) |")
    print("|---|---:|---|---:|" + "---:|" * (len(phases) + 1))
    for name in names:
        timer = engines[name].engine.engine_core.timer
        ratios = [a / b for a, b in zip(tok_s[name], tok_s["off"], strict=True)]
        stats = engines[name].stats().get("spec_decoding") or {}
        per_step = [1e3 * timer.seconds.get(p, 0.0) / max(timer.steps, 1) for p in phases]
        print(
            f"| {name} | {statistics.median(tok_s[name]):.1f} | {statistics.median(ratios):.3f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {stats.get('mean_acceptance_length', 0.0):.2f} | "
            + " | ".join(f"{t:.2f}" for t in per_step)
            + f" | {sum(per_step):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
